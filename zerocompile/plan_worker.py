"""One trace of a script, planned with several option sets: ``zerocompile tune``'s experiments
that differ from one another in pass options only (``config.PASS_OPTIONS``).

The worker (``python -m zerocompile.plan_worker --world-size N --hardware H --options JSON
[--no-replay] -- SCRIPT [ARGS...]``) runs ``plan_script`` with ``next_options``: Dynamo traces
the script once; after each measured step the worker writes the report as one JSON line on
stdout and reads the next options as one JSON line on stdin, every compiled frame runs its
passes again with them (``FrameRunner.recompile``) and the script's next step is measured. The
figures are those of a fresh ``zerocompile plan`` with the same options (a test checks them
equal, knob by knob).

Lines it writes: ``{"report": {...}}`` (plan's ``--json`` object), ``{"error": "..."}`` (these
options could not be planned; the worker waits for the next) and ``{"ended": "..."}`` (the script
ran out of steps before the step of these options, or could not be planned at all: the worker
exits). It reads ``{"options": {...}}``; end of input stops the script. The script's own output
goes to stderr.

``PlanWorkers`` is the other side: it plans each candidate on an idle worker of the same trace
(same options outside the pass options, same script arguments) or starts a new one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from zerocompile.config import PASS_OPTIONS

__all__ = ["PlanWorkers", "PlanWorker", "trace_key", "main"]


def trace_key(options: dict, script_args: list) -> str:
    """What a trace is bound to: the options outside ``PASS_OPTIONS`` and the script's arguments."""
    return json.dumps([{k: v for k, v in options.items() if k not in PASS_OPTIONS}, list(script_args)],
                      sort_keys=True, default=str)


class WorkerEnded(Exception):
    """The worker's script ended (out of steps) before it measured the options asked for."""


class PlanWorker:
    """A ``python -m zerocompile.plan_worker`` process: ``plan(options)`` one set at a time; the
    first must be the options it was started with (they compile the trace)."""

    def __init__(self, world_size: int, hardware: str, options: dict, script: Path, script_args: list,
                 replay: bool = True):
        self.key = trace_key(options, script_args)
        self.planned = 0
        self._first = options
        self._stderr = tempfile.TemporaryFile(mode="w+")      # the script's output: read on an error
        cmd = [sys.executable, "-m", "zerocompile.plan_worker", "--world-size", str(world_size), "--hardware",
               hardware, "--options", json.dumps(options), *([] if replay else ["--no-replay"]), "--", str(script),
               *script_args]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def plan(self, options: dict) -> dict:
        """Plan's report of ``options`` on this trace; ``RuntimeError`` with why not, or
        ``WorkerEnded`` when the script ran out of steps first (the worker is gone then)."""
        if self.planned == 0:
            if options != self._first:
                raise ValueError("a worker's first options are those it was started with")
        else:
            try:
                self._proc.stdin.write(json.dumps({"options": options}) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                raise WorkerEnded("the worker's process has ended") from None
        self.planned += 1
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            raise RuntimeError(self._last_words())
        message = json.loads(line)
        if "report" in message:
            return message["report"]
        if "error" in message:
            raise RuntimeError(message["error"])
        self._proc.wait()
        if self.planned == 1:           # the trace itself could not be planned
            why = message["ended"]
            if "exited with code" in why:    # the script failed: its own last words beside plan's
                why += f" (its last line: {self._last_words()})"
            raise RuntimeError(why)
        raise WorkerEnded(message["ended"])

    def _last_words(self) -> str:
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().strip().splitlines() if ln.strip()]
        return lines[-1] if lines else f"(no output; exit code {self._proc.returncode})"

    def close(self) -> None:
        """End the script (end of input) and the process."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


class PlanWorkers:
    """Plans candidates on traces kept alive: ``plan(options, script_args)`` uses an idle worker
    of the same trace (``trace_key``) or starts one; at most ``max_idle`` idle workers are kept
    (the least recently used is closed). Thread-safe: ``--jobs`` candidates plan at once, each
    on a worker of its own."""

    def __init__(self, world_size: int, hardware: str, script: Path, replay: bool = True, max_idle: int = 4):
        self.world_size, self.hardware, self.script, self.replay = world_size, hardware, script, replay
        self.max_idle = max_idle
        self.started = 0
        """Workers started (traces made)."""
        self.reused = 0
        """Candidates planned on a trace made for an earlier one."""
        self.ran_out = 0
        """Workers whose script ran out of steps while they were asked for more."""
        self._idle: list[PlanWorker] = []
        self._lock = threading.Lock()

    def plan(self, options: dict, script_args: list) -> tuple[dict, bool]:
        """Plan's report of ``options`` and whether it reused a trace; ``RuntimeError`` with
        plan's error otherwise."""
        key = trace_key(options, script_args)
        with self._lock:
            worker = next((w for w in reversed(self._idle) if w.key == key), None)
            if worker is not None:
                self._idle.remove(worker)
        reused = False
        if worker is not None:
            try:
                report = worker.plan(options)
                reused = True
            except WorkerEnded:
                with self._lock:
                    self.ran_out += 1
                worker.close()
                worker = None
            except RuntimeError:
                self._put_back(worker)
                raise
        if worker is None:
            worker = PlanWorker(self.world_size, self.hardware, options, self.script, script_args, self.replay)
            with self._lock:
                self.started += 1
            try:
                report = worker.plan(options)
            except RuntimeError:
                self._put_back(worker)
                raise
        if reused:
            with self._lock:
                self.reused += 1
        self._put_back(worker)
        return report, reused

    def _put_back(self, worker: PlanWorker) -> None:
        if not worker.alive:
            worker.close()
            return
        with self._lock:
            self._idle.append(worker)
            extra = self._idle[:-self.max_idle] if len(self._idle) > self.max_idle else []
            del self._idle[:len(extra)]
        for w in extra:
            w.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.close()


# ----------------------------------------------------------------------------- the worker
def main(argv: list | None = None) -> int:
    from zerocompile.plan import PlanReplayError, hardware_from, plan_script, unmeasured_reason
    from zerocompile.script_runner import ScriptRunError

    parser = argparse.ArgumentParser(prog="python -m zerocompile.plan_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the script after --")
    script = Path(command[0])
    out = sys.stdout

    def say(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    def next_options(report):
        if report.error is not None:
            say({"error": report.error})
        elif report.measured_step == 0:
            say({"ended": f"{script} ended after {report.steps_seen - 1} more optimizer step(s): give it more "
                          "steps to plan more options on its trace"})
            return None
        elif report.replay_mismatch:
            say({"error": f"{report.replay_mismatch}, so its figures may be wrong; plan again without replay"})
        else:
            say({"report": report.as_dict()})
        line = sys.stdin.readline()
        return json.loads(line)["options"] if line.strip() else None

    try:
        report = plan_script(script, command[1:], args.world_size, json.loads(args.options),
                             hardware_from(args.hardware), stdout=sys.stderr, replay=not args.no_replay,
                             next_options=next_options)
    except (ScriptRunError, PlanReplayError) as exc:
        say({"ended": f"zerocompile plan: error: {exc}"})
        return 1
    if report.measured_step == 0:
        say({"ended": f"zerocompile plan: error: {unmeasured_reason(report, script)}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
