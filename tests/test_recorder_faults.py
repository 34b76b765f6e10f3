"""The training-run recorder under faults (`grpo_core.recorder`): two recorders of one rank at once, a SIGTERM, a
SIGKILL in the middle of a write, a full disk, arguments of the wrong type. A process that must die or race runs as a
child of the test (`_child`)."""

from __future__ import annotations

import errno
import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_core import recorder
from grpo_core.linear import linear_grpo_loss
from grpo_core.recorder import TrainingRecorder, write_exclusive
from harness.training import read_training_run

ROOT = Path(__file__).resolve().parents[1]


def _call(sign: float = 1.0, seed: int = 0) -> tuple:
    """A loss result of 4 sequences and its record arguments, advantages of sign `sign`."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(4, 5, 8, generator=g), torch.randn(16, 8, generator=g)
    ids, mask = torch.randint(0, 16, (4, 5), generator=g), torch.ones(4, 5, dtype=torch.bool)
    res = linear_grpo_loss(h, w, ids, -torch.rand(4, 5, generator=g) - 1, None, completion_mask=mask,
                           advantages=sign * (torch.rand(4, generator=g) + 0.5), beta=0.0, kernels="torch")
    return res, dict(input=h, completion_ids=ids, completion_mask=mask)


# The child's preamble: `_call` and `slow_write`, a write that takes a while (a signal comes in the middle of it).
PREAMBLE = f'''
import os, signal, sys, time, warnings
from pathlib import Path
from unittest import mock
import torch
from grpo_core import recorder
from grpo_core.linear import linear_grpo_loss
from grpo_core.recorder import TrainingRecorder

{inspect.getsource(_call)}
res, args = _call()
real_write = recorder.write_exclusive

def slow_write(table, path):
    time.sleep(0.5)
    real_write(table, path)
'''


def _child(script: str, *argv: str) -> subprocess.Popen:
    """A Python process running the preamble, then `script` (with `sys.argv[1:]` = `argv`)."""
    return subprocess.Popen([sys.executable, "-c", PREAMBLE + textwrap.dedent(script), *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(script: str) -> subprocess.CompletedProcess:
    proc = _child(script)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _advantage_signs(run: Path) -> set[float]:
    df, _ = read_training_run(run)
    return set(np.sign(df.loc[df["field"] == "advantages", "value"]))


def test_a_second_recorder_of_a_rank_is_refused_before_it_writes_anything(tmp_path):
    """The race of the issue, made certain: the second recorder flushes while the first one's step 1 is being written
    (its file does not exist yet). It is refused in one line naming the folder's lock and its holder, and writes
    nothing: the folder holds the first run's steps alone, whole."""
    run, pos, neg = tmp_path / "run", _call(1.0), _call(-1.0)
    first, second = TrainingRecorder(run), TrainingRecorder(run)
    first.record(pos[0], step=1, **pos[1])
    second.record(neg[0], step=1, **neg[1])
    go, keys = threading.Event(), recorder.sequence_keys
    with mock.patch.object(recorder, "sequence_keys", lambda *a: go.wait(10) and keys(*a)):
        first.flush(wait=False)
        with pytest.raises(ValueError) as refused:
            second.flush()
        go.set()
        first.record(pos[0], step=2, **pos[1])
    first.close()
    assert str(refused.value) == (f"record_dir: expected no other recorder of rank 0 in {run} (one recorder writes a "
                                  f"rank's files), got {run / 'rank-00000' / '.lock'} held by process {os.getpid()}")
    assert _names(run / "rank-00000") == ["step-0000001.parquet", "step-0000002.parquet"]
    assert _advantage_signs(run) == {1.0}
    with pytest.raises(ValueError, match=r"^record_dir: expected no other recorder of rank 0 .* got "
                                         r".*step-0000001.parquet, written by another one$"):
        second.close()  # the lock is free now, the folder another run's


def test_two_processes_recording_one_rank_at_once_never_mix(tmp_path):
    """Two processes record 20 steps of rank 0 into one folder at once (the same metadata, advantages of opposite
    sign): one records them all, the other stops at its first step's hand-off, in one line, having written nothing."""
    script = '''
        sign, run = float(sys.argv[1]), Path(sys.argv[2])
        rec = TrainingRecorder(run, metadata={"world_size": 1})
        res, args = _call(sign)
        (run.parent / f"ready{sign}").touch()
        while not (run.parent / "go").exists():
            time.sleep(0.001)
        try:
            for step in range(1, 21):
                rec.record(res, step=step, **args)
                rec.flush(wait=False)
            rec.close()
        except ValueError as exc:
            print(exc, file=sys.stderr)
            sys.exit(3)
    '''
    procs = {sign: _child(script, str(sign), str(tmp_path / "run")) for sign in (1.0, -1.0)}
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{s}").exists() for s in procs) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs.values()), "a child ended before the start"
        time.sleep(0.01)
    (tmp_path / "go").touch()
    done = {sign: (p.wait(timeout=120), p.communicate()[1]) for sign, p in procs.items()}
    assert sorted(code for code, _ in done.values()) == [0, 3], done
    winner = next(sign for sign, (code, _) in done.items() if code == 0)
    loser_err = next(err for code, err in done.values() if code == 3)
    assert re.fullmatch(r"record_dir: expected no other recorder of rank 0 in \S+ \((one recorder writes a rank's "
                        r"files|a recorded step is never replaced)\), got \S+ (held by process \d+|written by another "
                        r"one)\n", loser_err), loser_err
    assert _names(tmp_path / "run" / "rank-00000") == [f"step-{s:07d}.parquet" for s in range(1, 21)]
    assert _advantage_signs(tmp_path / "run") == {winner}


def test_write_exclusive_never_replaces_a_file(tmp_path):
    """The one way a recorder's file is written: whole, then linked into place; a file already there is kept as it was,
    and no temporary file is left. Where the file system has no hard links, a rename into place, never over a file."""
    table = pa.table({"x": [1.0, 2.0]})
    path = tmp_path / "step-0000001.parquet"
    path.write_bytes(b"another run's")
    with pytest.raises(FileExistsError):
        write_exclusive(table, path)
    assert path.read_bytes() == b"another run's" and _names(tmp_path) == [path.name]
    no_links = OSError(errno.EPERM, "Operation not permitted")
    with mock.patch.object(os, "link", side_effect=no_links):
        with pytest.raises(FileExistsError):
            write_exclusive(table, path)
        assert path.read_bytes() == b"another run's"
        write_exclusive(table, tmp_path / "step-0000002.parquet")
    assert pq.read_table(tmp_path / "step-0000002.parquet").equals(table)
    assert _names(tmp_path) == [path.name, "step-0000002.parquet"]


@pytest.mark.parametrize("when", ["after the trainer's hand-off", "while the next step is recorded"])
def test_a_sigterm_keeps_every_step_handed_off_and_the_one_being_recorded(tmp_path, when):
    """SIGTERM (a job scheduler's) while step 1 is being written in the background: the process ends by SIGTERM, as
    it would have, once step 1 (and step 2, whose calls were being recorded) is on disk, whole."""
    script = f'''
        with mock.patch.object(recorder, "write_exclusive", slow_write):
            rec = TrainingRecorder({str(tmp_path / "run")!r})
            rec.record(res, step=1, **args)
            {"rec.flush(wait=False)" if when.startswith("after") else "rec.record(res, step=2, **args)"}
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("not ended")
    '''
    proc = _run(script)
    assert proc.returncode == -signal.SIGTERM and proc.stdout == "", proc.stderr
    steps = [1] if when.startswith("after") else [1, 2]
    assert _names(tmp_path / "run" / "rank-00000") == [f"step-{s:07d}.parquet" for s in steps]
    df, meta = read_training_run(tmp_path / "run")
    assert meta["steps"] == len(steps) and sorted(set(df["step"])) == steps


def test_a_sigterm_runs_the_earlier_handler_and_a_sigterm_in_a_flush_waits_for_its_end(tmp_path):
    """A Python handler installed before the recorder runs after the step is written, and the process goes on (its
    recorder too); at `close` it is SIGTERM's handler again. A SIGTERM that comes in the middle of a `flush` (here
    while the step leaves the device) waits for the flush's end: the step is handed off once, and written once."""
    script = f'''
        run = Path({str(tmp_path / "run")!r})
        def earlier(signum, frame):
            print("earlier handler, step 1 written:", (run / "rank-00000" / "step-0000001.parquet").exists())
        signal.signal(signal.SIGTERM, earlier)

        class Interrupted(recorder._HostCopy):
            sent = False

            def __init__(self, *a):
                if not Interrupted.sent:
                    Interrupted.sent = True
                    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in the middle of the flush
                super().__init__(*a)

        with mock.patch.object(recorder, "write_exclusive", slow_write):
            rec = TrainingRecorder(run)
            rec.record(res, step=1, **args)
            with mock.patch.object(recorder, "_HostCopy", Interrupted):
                rec.flush(wait=False)
            rec.record(res, step=2, **args)
            rec.close()
        print("restored:", signal.getsignal(signal.SIGTERM) is earlier)
    '''
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "earlier handler, step 1 written: True\nrestored: True\n"
    assert _names(tmp_path / "run" / "rank-00000") == ["step-0000001.parquet", "step-0000002.parquet"]


def test_after_an_earlier_handler_lets_the_process_go_on_its_step_goes_on_too(tmp_path):
    """A SIGTERM whose earlier handler does not end the process (a scheduler's "checkpoint, then stop later"): the step
    being recorded stays open, so its next micro-batch is recorded into it and the step is written once, whole."""
    script = f'''
        signal.signal(signal.SIGTERM, lambda signum, frame: print("earlier handler"))
        rec = TrainingRecorder({str(tmp_path / "run")!r})
        rec.record(res, step=1, **args)
        os.kill(os.getpid(), signal.SIGTERM)
        rec.record(res, step=1, micro_batch=1, **args)
        rec.close()
    '''
    proc = _run(script)
    assert proc.returncode == 0 and proc.stdout == "earlier handler\n", proc.stderr
    df, _ = read_training_run(tmp_path / "run")
    assert sorted(df.loc[df["field"] == "loss", "micro_batch"].tolist()) == [0, 1]


def test_the_exit_writes_the_step_being_recorded_and_a_forked_child_writes_nothing(tmp_path):
    """A script that ends without `close` has its last step written at the exit, and the folder given up. A child
    forked while a step is recorded (a data loader's worker) holds a copy of the recorder: neither its SIGTERM nor its
    exit writes the copy's step (the parent writes it once)."""
    script = f'''
        rec = TrainingRecorder({str(tmp_path / "run")!r})
        rec.record(res, step=1, **args)
        for end in ("sigterm", "exit"):
            pid = os.fork()
            if pid == 0:
                if end == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(30)
                sys.exit(0)
            print(end, os.waitpid(pid, 0)[1], flush=True)  # before the next fork: its child would print it again
    '''
    proc = _run(script)
    assert proc.returncode == 0 and "record_dir" not in proc.stderr, proc.stderr
    assert proc.stdout == f"sigterm {signal.SIGTERM}\nexit 0\n"  # the children's wait statuses
    assert _names(tmp_path / "run" / "rank-00000") == ["step-0000001.parquet"]
    df, _ = read_training_run(tmp_path / "run")
    assert set(df["step"]) == {1}


def test_a_killed_write_leaves_a_temporary_file_named_for_its_step_rank_and_process(tmp_path):
    """A SIGKILL in the middle of step 2's write: step 1 stays whole and the run reads; the partial file is
    `rank-<R>/step-<S>.parquet.<pid>.tmp`, ignored by the reader, and a new recorder refuses the folder naming it."""
    run = tmp_path / "run"
    script = f'''
        import pyarrow.parquet as pq
        rec = TrainingRecorder({str(run)!r}, rank=3)
        rec.record(res, step=1, **args)
        rec.flush()
        rec.record(res, step=2, **args)
        real = pq.write_table
        def killed(table, path):
            real(table, path)
            os.kill(os.getpid(), signal.SIGKILL)
        with mock.patch.object(pq, "write_table", killed):
            rec.flush()
    '''
    proc = _child(script)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    folder = run / "rank-00003"
    assert _names(folder) == [".lock", "step-0000001.parquet", f"step-0000002.parquet.{proc.pid}.tmp"]
    assert read_training_run(run)[1]["steps"] == 1
    (folder / "step-0000001.parquet").unlink()
    with pytest.raises(ValueError, match=rf"^record_dir: expected a new folder or one without rank 3's files \(a "
                                         rf"recorded run is never replaced\), got {re.escape(str(run))}, which holds "
                                         rf"{re.escape(str(folder))}/step-0000002\.parquet\.{proc.pid}\.tmp$"):
        TrainingRecorder(run, rank=3)


def test_a_full_disk_is_one_line_naming_the_folder_and_the_step(tmp_path):
    """A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG) as a full disk. By default the flush
    raises one line naming the step and the folder; with `on_write_error="warn"` each lost step is warned of once and
    the recording goes on. No partial file is left."""
    script = f'''
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        stopping = TrainingRecorder({str(tmp_path / "raise")!r})
        going_on = TrainingRecorder({str(tmp_path / "warn")!r}, on_write_error="warn")
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
        stopping.record(res, step=1, **args)
        try:
            stopping.flush()
        except OSError as exc:
            print("raised", exc.errno, exc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            going_on.record(res, step=1, **args)
            going_on.flush(wait=False)
            going_on.record(res, step=2, **args)
            going_on.flush()
            going_on.record(res, step=3, **args)
            going_on.close()
        for w in caught:
            print("warned", w.category.__name__, w.message)
    '''
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    too_large = r"\(OSError: \[Errno 27\] [^)]*File too large\)"
    assert re.fullmatch(rf"raised 27 record_dir: step 1 was not written {too_large} to "
                        rf"{re.escape(str(tmp_path / 'raise' / 'rank-00000'))}", lines[0]), lines
    assert len(lines) == 4, lines
    for step, line in zip((1, 2, 3), lines[1:]):
        assert re.fullmatch(rf"warned RuntimeWarning record_dir: step {step} was not written {too_large} to "
                            rf"{re.escape(str(tmp_path / 'warn' / 'rank-00000'))}; recording goes on "
                            rf"\(on_write_error='warn'\)", line), line
    assert _names(tmp_path / "raise" / "rank-00000") == [".lock"]  # held: the step waits to be flushed again
    assert _names(tmp_path / "warn" / "rank-00000") == []


def test_with_warn_a_lost_step_is_warned_of_once_and_the_next_ones_are_written(tmp_path):
    """`on_write_error="warn"`: step 2's write fails in the background (no space left); it is warned of once, no later
    flush raises it, and steps 1 and 3 are written."""
    res, args = _call()
    rec = TrainingRecorder(tmp_path / "run", on_write_error="warn")
    real, full = recorder.write_exclusive, OSError(errno.ENOSPC, "No space left on device")

    def write(table, path):
        if path.name == "step-0000002.parquet":
            raise full
        real(table, path)

    with warnings.catch_warnings(record=True) as caught, mock.patch.object(recorder, "write_exclusive", write):
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            rec.record(res, step=step, **args)
            rec.flush(wait=False)
        rec.close()
    assert [str(w.message) for w in caught] == [
        f"record_dir: step 2 was not written (OSError: [Errno {errno.ENOSPC}] No space left on device) to "
        f"{tmp_path / 'run' / 'rank-00000'}; recording goes on (on_write_error='warn')"]
    assert _names(tmp_path / "run" / "rank-00000") == ["step-0000001.parquet", "step-0000003.parquet"]
    # the default: the same failure, written at once, is raised in one line that keeps the errno
    rec = TrainingRecorder(tmp_path / "raise")
    rec.record(res, step=1, **args)
    with mock.patch.object(recorder, "write_exclusive", side_effect=full), pytest.raises(OSError) as raised:
        rec.flush()
    assert raised.value.errno == errno.ENOSPC and "\n" not in str(raised.value)
    assert rec.flush() == tmp_path / "raise" / "rank-00000" / "step-0000001.parquet"  # the step stayed
    rec.close()


def test_arguments_of_the_wrong_type_are_named_in_one_line(tmp_path, monkeypatch):
    res, args = _call()
    rec = TrainingRecorder(tmp_path / "run")
    ids, mask = args["completion_ids"], args["completion_mask"]
    bad_calls = [
        (dict(completion_mask=mask.tolist()), "completion_mask: expected a torch.Tensor, got list"),
        (dict(completion_ids=ids.tolist()), "completion_ids: expected a torch.Tensor, got list"),
        (dict(input=args["input"].numpy()), "input: expected a torch.Tensor, got numpy.ndarray; convert it with "
                                            "torch.from_numpy(...)"),
        (dict(prompt_ids=[[1, 2]] * 4), "prompt_ids: expected a torch.Tensor or None, got list"),
        (dict(old_logps=np.zeros((4, 5))), "old_logps: expected a torch.Tensor or None, got numpy.ndarray; convert "
                                           "it with torch.from_numpy(...)"),
        (dict(result=None), "result: expected the GRPOLossResult the loss returned, got None"),
        (dict(result=tuple(res)), "result: expected the GRPOLossResult the loss returned, got tuple")]
    for kw, message in bad_calls:
        with pytest.raises(ValueError) as refused:
            rec.record(**{"result": res, "step": 1, **args, **kw})
        assert str(refused.value) == message
    monkeypatch.chdir(tmp_path)
    bad_recorders = [
        (dict(record_dir=""), "record_dir: expected a folder's path (the empty one would be the current folder), "
                              "got ''"),
        (dict(record_dir=None), "record_dir: expected a folder's path (the empty one would be the current folder), "
                                "got None"),
        (dict(metadata=[1, 2]), "metadata: expected a dict or None, got list [1, 2]"),
        (dict(metadata="abc"), "metadata: expected a dict or None, got str 'abc'"),
        (dict(on_write_error="ignore"), "on_write_error: expected 'raise' or 'warn', got 'ignore'")]
    for kw, message in bad_recorders:
        with pytest.raises(ValueError) as refused:
            TrainingRecorder(**{"record_dir": tmp_path / "new", **kw})
        assert str(refused.value) == message
    assert _names(tmp_path) == ["run"]  # nothing in the current folder, no folder made for a refused recorder
