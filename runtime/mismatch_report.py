"""The collective watchdog's judgement (``runtime/collective_watch.py``): from every rank's
report (``runtime/position_exchange.py``), whether the ranks have parted, and the table and
likely cause that ``CollectiveMismatchError`` says.

A *site* names one collective: ``where|graph|index|count|kind|bytes|params``, where ``where``
is the frame (or, for eager code, the call's label), ``graph`` one of ``forward``,
``backward``, ``inference`` or ``eager``, ``index`` its place among the graph's ``count``
collectives (-1 in eager code), and ``params`` the parameters it carries, comma-separated.
Graph sites are fixed when the graph is compiled (``passes/lowerings/watch_collectives.py``).

Rules, for a rank that waited past the timeout at its site:

- a peer blocked at another zerocompile collective, in one of ``torch.distributed``'s own
  collectives, or finished: a mismatch (an error);
- a peer that gave no answer: gone if the transport also failed, or if it did not answer twice;
  the first time it may only be holding the interpreter lock, and the wait starts again;
- a peer running code (computing, compiling, in the user's code): busy, wait again, up to
  ``collective_busy_limit_s``;
- every peer at the same collective: the transport is slow, wait again.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerocompile.errors import CollectiveMismatchError

_MOMENT = 1.0
"""Seconds a peer must have waited at another collective to count as blocked there (a peer
that just went on to the next collective while this rank's is still finishing is not)."""

_EAGER_CALLS = ("full_state_dict", "save_checkpoint", "load_checkpoint", "gathered_parameters", "save_pretrained",
                "generate")


def site(where: str, graph: str, index: int, count: int, kind: str, nbytes: int, params) -> str:
    """The site string of one collective (see the module docstring)."""
    return "|".join([where.replace("|", "/"), graph, str(index), str(count), kind, str(nbytes), ",".join(params)])


def describe(s: str | None) -> str:
    """A site in words: ``frame 0/0 forward graph: all_gather 2 of 6 (1.5 MiB; h.0.attn.weight)``."""
    if not s:
        return "none"
    where, graph, index, count, kind, nbytes, params = s.split("|")
    names = params.split(",") if params else []
    carried = "; " + ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names else ""
    if graph == "eager":
        return f"{where}: {kind} ({_size(int(nbytes))}{carried})"
    if index == "-1":        # point-to-point transfers: their ops carry no site
        return f"{where} {graph} graph: {kind} by point-to-point transfers ({_size(int(nbytes))})"
    return f"{where} {graph} graph: {kind} {int(index) + 1} of {count} ({_size(int(nbytes))}{carried})"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _parts(s: str | None) -> list[str]:
    return s.split("|") if s else [""] * 7


@dataclass
class Verdict:
    """What the watchdog found: ``error`` to raise (None: wait again), ``text`` to log, and how
    many peers gave no answer (``unanswered``: the next ``judge`` call's ``missed``)."""

    error: CollectiveMismatchError | None
    text: str
    unanswered: int = 0


def judge(my_site: str, waited: float, reports: dict | None, me: int, missed: int = 0, transport_error=None,
          busy_limit_s: float | None = None) -> Verdict:
    """The verdict for rank ``me``, which waited ``waited`` s at ``my_site``; ``reports``: every
    rank's report (``PositionExchange.ask``), None without an exchange."""
    head = f"zerocompile: rank {me} waited {waited:.1f} s at {describe(my_site)}"
    if reports is None:
        if transport_error is not None:
            return _error(f"{head}, and the transport failed: {transport_error}", {}, "")
        return Verdict(None, f"{head}; the other ranks' positions are unknown (the process group's store is not a "
                             "TCPStore): waiting again")
    if "store" in reports:
        cause = ("the process group's store, which rank 0's process hosts, cannot be reached "
                 f"({reports['store']}): rank 0 has exited or died; see its log")
        text = f"{head}.\nLikely cause: {cause}." + (f"\nTransport error: {transport_error}" if transport_error else "")
        return _error(text + "\n" + _AFTER, {}, cause)
    mine = reports[me]
    blocked, busy, silent = [], [], []
    for r, rep in sorted(reports.items()):
        if r == me:
            continue
        if rep is None:
            silent.append(r)
        elif rep["state"] in ("finished", "exited", "collective"):
            blocked.append(r)
        elif rep["state"] == "waiting":
            same = rep["site"] == my_site and rep["steps"] == mine["steps"]
            if not same and rep["since"] >= _MOMENT:
                blocked.append(r)
            elif not same:
                busy.append(r)
        else:
            busy.append(r)
    table = _table(reports, me)
    dead = silent if (transport_error is not None or missed) else []
    if blocked or dead or (transport_error is not None):
        cause = _cause(reports, me, blocked, dead, transport_error)
        text = f"{head}, a collective that not every rank reached:\n{table}\nLikely cause: {cause}"
        if transport_error is not None:
            text += f"\nTransport error: {str(transport_error).splitlines()[0]}"
        return _error(text + "\n" + _AFTER, reports, cause)
    if busy and busy_limit_s is not None and waited >= busy_limit_s:
        cause = (f"rank(s) {_ranks(busy)} stayed busy (not in a collective) for longer than collective_busy_limit_s "
                 f"= {busy_limit_s:g} s; raise it, or set it to None to wait for busy ranks as long as the process "
                 "group's own timeout allows")
        return _error(f"{head}:\n{table}\nLikely cause: {cause}\n{_AFTER}", reports, cause)
    if silent:
        why = f"rank(s) {_ranks(silent)} gave no answer (busy without releasing Python's lock, or gone): waiting again"
    elif busy:
        why = f"rank(s) {_ranks(busy)} are busy (computing, compiling or in their own code): waiting again"
    else:
        why = "every rank waits at this collective: the transport is slow; waiting again"
    return Verdict(None, f"{head}; {why}:\n{table}", unanswered=len(silent))


def found_by_peer(my_site: str, waited: float, peer: dict) -> CollectiveMismatchError:
    """The error of a rank that waited ``waited`` s at ``my_site`` when another rank's verdict
    (``PositionExchange.peer_verdict``) said the ranks have parted: that rank's table and cause."""
    text = (f"zerocompile: this rank waited {waited:.1f} s at {describe(my_site)}; rank {peer['asker']} found that "
            f"the ranks' collectives parted:\n{peer['text']}")
    return CollectiveMismatchError(text, peer["reports"], peer["cause"])


_AFTER = ("What now: this process group is out of step (the collective abandoned here is still queued on it, "
          "so the next one may pair with the wrong collective). In an `except`, save only what needs no "
          "collective (e.g. this rank's own files), then exit; restart from the last checkpoint.")


def _error(text: str, reports: dict, cause: str) -> Verdict:
    return Verdict(CollectiveMismatchError(text, reports, cause), text)


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _table(reports: dict, me: int) -> str:
    rows = [("rank", "state", "position")]
    for r, rep in sorted(reports.items()):
        rows.append((str(r), *_row(rep)))
    width = max(len(row[1]) for row in rows)
    return "\n".join(f"  {r:<5} {state:<{width}}  {pos}" for r, state, pos in rows)


def _row(rep: dict | None) -> tuple[str, str]:
    if rep is None:
        return "no answer", "(the process died, or hangs outside Python)"
    counts = _counts(rep)
    step = f"step {rep.get('steps', 0)}" + (f" ({counts[0]} forward, {counts[1]} backward since the last step)"
                                             if counts[0] or counts[1] else "")
    at = f" at {rep['where']}" if rep.get("where") else ""
    last = (f"; last zerocompile collective {rep['last_ago']:.1f} s ago: {describe(rep['last'])}"
            if rep.get("last") else "; no zerocompile collective yet")
    state = rep["state"]
    if state == "waiting":
        return f"waiting {rep['since']:.1f} s", f"{describe(rep['site'])}, {step}{at}"
    if state == "collective":
        return f"in {rep['call']}", f"{step}{at}{last}"
    if state == "exited":
        return f"exited {rep['ago']:.1f} s ago", f"step {rep.get('steps', 0)}{last}"
    if state == "finished":
        return "finished", f"the script's main thread ended, {step}{last}"
    scope = f" ({rep['scope']})" if rep.get("scope") else ""
    since = f" since {rep['last_ago']:.1f} s" if rep.get("last") else ""
    return f"busy{scope}{since}", f"{step}{at}{last}"


def _counts(rep: dict | None) -> tuple[int, int]:
    """Forwards and backwards run since the last step, of the frame that ran most."""
    calls = (rep or {}).get("calls") or {}
    return max((tuple(v) for v in calls.values()), default=(0, 0))


def _cause(reports: dict, me: int, blocked: list, dead: list, transport_error) -> str:
    if dead:
        how = " and the transport reports a lost connection" if transport_error is not None else " twice"
        return (f"rank(s) {_ranks(dead)} gave no answer{how}: the process has died (killed, out of memory, a "
                "crash) or hangs outside Python. See its log; the job cannot go on without it.")
    if transport_error is not None and not blocked:
        return ("the transport failed while every rank still answers: see the transport error below "
                "(a network problem, or a rank that closed the process group).")
    live = {r: rep for r, rep in reports.items() if rep is not None}
    graphs = {r: _parts(rep.get("site"))[1] if rep["state"] == "waiting" else rep["state"] for r, rep in live.items()}
    wheres = {r: _parts(rep.get("site"))[0] for r, rep in live.items() if rep["state"] == "waiting"}
    calls = [w for w in wheres.values() if w in _EAGER_CALLS]
    if calls:
        inside = [r for r, w in wheres.items() if w in _EAGER_CALLS]
        return (f"{calls[0]} ran on rank(s) {_ranks(inside)} only. It gathers from every rank: call it on every "
                "rank (with rank0_only=True, the default, only rank 0 keeps the tensors; write the file on rank 0 "
                "only).")
    compiling = [r for r, w in wheres.items() if w.startswith("compiling ")]
    if compiling and len(compiling) < len(graphs):
        return (f"a forward ran on rank(s) {_ranks(compiling)} only: it was compiling {wheres[compiling[0]][10:]} "
                "there (a forward under torch.no_grad(), a new input shape, or generation, met for the first time). "
                "At stage 3 every forward gathers parameters from every rank, and compiling one takes collectives "
                "at every stage, so every rank must run it: evaluate on every rank (each on its share of the "
                "data); read full weights with zerocompile.full_state_dict (called on every rank); generate with "
                "zerocompile.generate on every rank.")
    inference = [r for r, g in graphs.items() if g == "inference"]
    if inference and len(inference) < len(graphs):
        return (f"a forward ran on rank(s) {_ranks(inference)} only (without autograd: evaluation or generation). "
                "At stage 3 every forward gathers parameters from every rank, so every rank must run it: evaluate "
                "on every rank (each on its share of the data); read full weights with zerocompile.full_state_dict "
                "(called on every rank); generate with zerocompile.generate on every rank.")
    steps = {r: rep.get("steps", 0) for r, rep in live.items()}
    # a forward counts once it ran: one a rank waits in counts too
    counts = {r: (c[0] + (graphs[r] == "forward"), c[1]) for r, c in ((r, _counts(rep)) for r, rep in live.items())}
    detail = "; ".join(f"rank {r}: step {steps[r]}, {counts[r][0]} forward, {counts[r][1]} backward"
                       for r in sorted(live))
    finished = [r for r in blocked if live[r]["state"] in ("finished", "exited")]
    if finished:
        return (f"rank(s) {_ranks(finished)} finished while the others still run collectives ({detail}): the ranks "
                "got different numbers of batches or steps. Give every rank the same number "
                "(DistributedSampler(drop_last=True) or DataLoader(drop_last=True)).")
    if len(set(steps.values())) > 1:
        return (f"the ranks are at different optimizer steps ({detail}): a step was skipped on some ranks only "
                "(e.g. `if not torch.isfinite(loss): continue`). Decide on every rank alike: all-reduce the "
                "condition first (dist.all_reduce(flag, op=dist.ReduceOp.MAX)) and skip on every rank.")
    outside = [r for r, g in graphs.items() if g == "collective"]
    if outside:
        return (f"rank(s) {_ranks(outside)} wait in a torch.distributed collective of their own while the others "
                "run zerocompile's: a zerocompile model was run, or its optimizer stepped, on some ranks only. "
                "Run it on every rank.")
    pending = {r: c[0] - c[1] for r, c in counts.items()}
    if max(pending.values()) >= 2:      # a forward whose backward never ran, and another since
        skipped = [r for r, p in pending.items() if p >= 2]
        return (f"rank(s) {_ranks(skipped)} ran a forward without its backward ({detail}): a step skipped on some "
                "ranks only (e.g. `if not torch.isfinite(loss): continue` before loss.backward()). Decide on every "
                "rank alike: all-reduce the condition first and skip on every rank.")
    if len({c[0] for c in counts.values()}) > 1:
        more = [r for r, c in counts.items() if c[0] == max(c[0] for c in counts.values())]
        return (f"the ranks ran different numbers of forward passes since the last step ({detail}): rank(s) "
                f"{_ranks(more)} ran one more. Either different numbers of micro-batches (an uneven last batch: "
                "DistributedSampler(drop_last=False), or data split unevenly; give every rank the same number of "
                "batches: DistributedSampler(drop_last=True) or DataLoader(drop_last=True)), or a step skipped on "
                "some ranks only (e.g. `if not torch.isfinite(loss): continue`; decide on every rank alike: "
                "all-reduce the condition first and skip on every rank).")
    sites = {rep["site"] for rep in live.values() if rep["state"] == "waiting"}
    if len(sites) > 1:
        frames = sorted({_parts(x)[0] for x in sites})
        return (f"the ranks wait at different collectives ({', '.join(frames)}): a module runs on some ranks only "
                "(e.g. an MoE expert that received no tokens on this rank). Mark such modules with "
                "zerocompile.set_leaf_modules(model, [ExpertClass]) so their parameters are gathered whether they "
                "run or not, or run every module on every rank.")
    return "the ranks issued different collectives; compare the positions above."
