"""The runtime of zerocompile (installed as ``zerocompile.runtime``): shard store,
collectives, the functions compiled graphs call, and accounting."""
