"""Records a training run at the loss: every call's per-sequence numbers, with their bits, keyed by the sequence.

    rec = TrainingRecorder("runs/my-run", rank=dp_rank)       # GRPOCoreTrainer(..., record_dir=...) does this
    result = linear_grpo_loss(hidden, weight, completion_ids, old_logps, None, mask, advantages=adv, ...)
    rec.record(result, step=step, input=hidden, completion_ids=completion_ids, completion_mask=mask,
               prompt_ids=prompt_ids, prompt_mask=prompt_mask, old_logps=old_logps, micro_batch=i)
    result.loss.backward()                                   # the gradient of `input` is digested in its hook
    rec.close()                                              # or: the next step's first record hands it off

Each optimizer step of each rank becomes one Parquet file, `rank-<R>/step-<S>.parquet`, written whole and then linked
into place, never over a file (`write_exclusive`): a run can be read while it goes on. One recorder writes a rank's
folder: from its first write to `close` it holds `rank-<R>/.lock`, and another one is refused before it writes
anything. One row per (step, sequence, field): the value and its exact bit pattern, or a digest. A sequence is found
by its key, a hash of its prompt's and completion's active token ids, not by where it sat, so two runs with other ranks,
micro-batches or accumulation are compared sequence by sequence (`python -m harness diff`, `python -m reports drift`).

Per sequence: the result's `per_sequence_policy`, `per_sequence_kl`, `advantages` (sequence-level ones),
`per_sequence_active_tokens` and `per_sequence_entropy` (when computed), and four digests:
- `input_digest`: the active rows of the loss's differentiable input (the hidden states of the fused linear loss, the
  logits of the logits ops), their bits;
- `logps_digest`: the given old and reference log-probs, importance-sampling ratio and token-level advantages at
  the active tokens (absent when none is given);
- `grad_digest`: the active rows of that input's gradient, taken in a hook during the backward (absent when no
  backward ran), and `grad_mantissa_digest`: their bits less the exponents (unmoved by a power-of-two scale).
Per call, the scalars `loss`, `policy_loss` and `kl` under the sequence `rank<R>/micro-batch<M>`.

A digest is `grpo_core.digest.row_digests`: exact integer arithmetic on the bit patterns, the same bits give the same
digest on every device; it is computed where the tensor lives (one read of it; a call's digests in one matmul). A
step's numbers and token ids leave the device in one copy queued without a host synchronization when the next step
begins (or the trainer's step ends), and a background thread writes the file.

A stopped run keeps its steps: on SIGTERM (how a job scheduler ends a run) and at the interpreter's exit, every open
recorder of the process waits for the step being written and writes the step being recorded, with the calls recorded so
far; then SIGTERM ends the process as it would have (or its earlier Python handler runs). The handler is installed from
the main thread and runs once that thread runs Python code again (not in the middle of a collective). A SIGKILL loses
the step being written, whose partial file stays as `rank-<R>/step-<S>.parquet.<pid>.tmp`, and the step not handed off
yet. A write that fails (a full disk) is one line naming the folder and the step: raised (`on_write_error="raise"`, the
default) or warned of once, the recording going on (`"warn"`).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import functools
import hashlib
import json
import os
import platform
import signal
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checks import _type_name, check_tensor
from .contract import MATH_VERSION
from .digest import LANES, RowDigests, mantissas
from .reproducible import determinism_settings
from .rollouts import rollout_table
from .result import GRPOLossResult

__all__ = ["TrainingRecorder", "key_of", "sequence_keys"]

SEQUENCE_FIELDS = ("per_sequence_policy", "per_sequence_kl", "advantages", "per_sequence_active_tokens",
                   "per_sequence_entropy")
DIGEST_FIELDS = ("input_digest", "logps_digest", "grad_digest", "grad_mantissa_digest")
SCALAR_FIELDS = ("loss", "policy_loss", "kl")
LAYER_FIELD = r"layer/\d{3}/\S+"  # a module's output digest (`record(layers=)`): its place in the forward, its name
KEY_FORMAT = "blake2b-64(int64le: prompt length, prompt ids, completion ids)"  # in every file: runs of one format match
LOCK = ".lock"  # in a rank's folder: held by the recorder writing it, and the holder's pid
NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}  # os.link's, where a file system has none


def _hex(digests: torch.Tensor) -> list[str]:
    """Each row's lanes (each below 2**31) as 8 hex digits apiece."""
    flat = digests.numpy().astype(">u4").tobytes().hex()
    width = 8 * digests.shape[1]
    return [flat[i:i + width] for i in range(0, len(flat), width)]


def sequence_keys(completion_ids: torch.Tensor, completion_mask: torch.Tensor, prompt_ids: torch.Tensor | None = None,
                  prompt_mask: torch.Tensor | None = None) -> list[str]:
    """One key per sequence: 16 hex digits of a BLAKE2b hash of its prompt's active token count (8 bytes), its
    prompt's active token ids and its completion's active token ids (int64 little-endian; padding never enters)."""
    def active(ids: torch.Tensor | None, mask: torch.Tensor | None) -> list[np.ndarray]:
        if ids is None:
            return [np.zeros(0, "<i8")] * completion_ids.shape[0]
        ids = ids.detach().cpu().numpy().astype("<i8")
        return list(ids) if mask is None else [row[k] for row, k in zip(ids, mask.detach().cpu().bool().numpy())]

    return [key_of(p, c) for p, c in zip(active(prompt_ids, prompt_mask), active(completion_ids, completion_mask))]


def key_of(prompt: Any, completion: Any) -> str:
    """The key of one sequence from its active prompt and completion ids (any integer sequences)."""
    p, c = np.asarray(prompt, dtype="<i8"), np.asarray(completion, dtype="<i8")
    return hashlib.blake2b(np.int64(len(p)).astype("<i8").tobytes() + p.tobytes() + c.tobytes(),
                           digest_size=8).hexdigest()


def _provenance(device: torch.device) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "machine": platform.machine(), "math_version": MATH_VERSION,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
            "device_type": device.type, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **determinism_settings()}


def write_exclusive(table: Any, path: Path) -> None:
    """Writes the Parquet `table` to `path`, which must not exist (else FileExistsError, the file untouched): whole to
    `<path>.<pid>.tmp` beside it, then hard-linked into place (an atomic create that never replaces) and the temporary
    file removed, so a reader sees no file or the whole one. A write that fails removes its temporary file; a killed one
    leaves it, its name saying which file and process. Where the file system has no hard links, the temporary file is
    renamed into place if `path` does not exist (the rank's lock alone keeps other recorders out)."""
    import pyarrow.parquet as pq

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in NO_HARD_LINKS:
                raise
            if path.exists():
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
            os.rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_open: set[TrainingRecorder] = set()  # recorders holding a step to write: written on SIGTERM and at exit
_previous_sigterm: Any = None  # the SIGTERM handler `_on_sigterm` replaced (while it is installed)


def _register(recorder: TrainingRecorder) -> None:
    """Counts `recorder` among the open ones, and installs `_on_sigterm` when it is not installed (from the main thread
    only, over the default action or a Python handler: one installed in C, or SIG_IGN, is left alone)."""
    global _previous_sigterm
    _open.add(recorder)
    if _previous_sigterm is None and threading.current_thread() is threading.main_thread():
        current = signal.getsignal(signal.SIGTERM)
        if current is signal.SIG_DFL or callable(current):
            _previous_sigterm = current
            signal.signal(signal.SIGTERM, _on_sigterm)


def _unregister(recorder: TrainingRecorder) -> None:
    """The reverse of `_register`: the last open recorder restores the handler `_on_sigterm` replaced (unless another
    one replaced it since)."""
    global _previous_sigterm
    _open.discard(recorder)
    if (not _open and _previous_sigterm is not None and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, _previous_sigterm)
        _previous_sigterm = None


def _on_sigterm(signum: int, frame: Any) -> None:
    """Writes every open recorder's steps, then ends the process as SIGTERM would have: the earlier Python handler runs
    once the steps handed off are written (the recorders stay open and keep the step being recorded: the process may
    go on, and its exit writes it), or the default action (they are closed first). A recorder in the
    middle of a `flush` raises the signal again when it ends (the handler runs between two of the main thread's
    bytecodes). A forked child's recorders are its parent's: it leaves them alone."""
    mine = [r for r in list(_open) if r._pid == os.getpid()]
    busy = [r for r in mine if r._flushing]
    for r in busy:
        r._sigterm = True
    if busy:
        return
    previous = _previous_sigterm if _previous_sigterm is not None else signal.SIG_DFL
    for r in mine:
        r._finish(close=not callable(previous))
    if callable(previous):
        previous(signum, frame)
    else:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


@atexit.register
def _at_exit() -> None:
    """At the interpreter's exit (the background writes have ended: the executor joins its threads first), writes and
    closes every open recorder of this process."""
    for r in [r for r in list(_open) if r._pid == os.getpid()]:
        r._finish(close=True)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


class _HostCopy:
    """Tensors copied to the host: those on `device` in one transfer (a CUDA device's into pinned memory, queued
    without a host synchronization; `tensors()` waits for it), any other one copied alone."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        self.specs = [(t.dtype, t.shape) for t in tensors]
        self.here = sorted((i for i, t in enumerate(tensors) if t.device == device),
                           key=lambda i: -tensors[i].element_size())  # the widest first: every piece stays aligned
        self.elsewhere = {i: t.detach().to("cpu", copy=True) for i, t in enumerate(tensors) if t.device != device}
        flat = torch.cat([tensors[i].detach().reshape(-1).view(torch.uint8) for i in self.here] or
                         [torch.empty(0, dtype=torch.uint8, device=device)])  # a copy: later writes do not reach it
        self.ready = None
        if device.type == "cuda":
            self.flat = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
            self.flat.copy_(flat, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(device))  # the copy's stream: the source device's
        else:
            self.flat = flat.cpu()

    def tensors(self) -> list[torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        out, offset = dict(self.elsewhere), 0
        for i in self.here:
            dtype, shape = self.specs[i]
            size = shape.numel() * dtype.itemsize
            out[i] = self.flat[offset:offset + size].view(dtype).view(shape)
            offset += size
        return [out[i] for i in range(len(self.specs))]


def _leaves(x: Any) -> list[torch.Tensor]:
    """The tensors of a nest of tuples, lists and dicts, in order (None holds none)."""
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return [t for v in items for t in _leaves(v)]


def _rebuild(x: Any, tensors: Any) -> Any:
    """`x` with its tensors replaced, in order, by the next ones of the iterator `tensors`."""
    if isinstance(x, torch.Tensor):
        return next(tensors)
    if isinstance(x, dict):
        return {k: _rebuild(v, tensors) for k, v in x.items()}
    return type(x)(_rebuild(v, tensors) for v in x) if isinstance(x, (tuple, list)) else x


class TrainingRecorder:
    """Appends every loss call of a training run to `record_dir` (see the module docstring). `rank`: this process's
    data-parallel rank (with tensor parallelism, record on TP rank 0 alone: its peers hold the same numbers);
    `metadata`: what describes the run (world size, accumulation, ...), stored with provenance in every file;
    `on_write_error`: what a step that cannot be written (a full disk) does, `"raise"` (training stops at the next
    `record`, `flush` or `close`) or `"warn"` (once a step; recording goes on with the next one)."""

    def __init__(self, record_dir: str | os.PathLike, *, rank: int = 0, metadata: dict[str, Any] | None = None,
                 on_write_error: str = "raise"):
        import pyarrow.parquet  # noqa: F401  here, not first in the writer's thread (a SIGTERM may wait for it)

        if not isinstance(record_dir, (str, os.PathLike)) or os.fspath(record_dir) == "":
            raise ValueError(f"record_dir: expected a folder's path (the empty one would be the current folder), got "
                             f"{record_dir!r}")
        _check_count("rank", rank)
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"metadata: expected a dict or None, got {_type_name(metadata)} {metadata!r}")
        if not isinstance(on_write_error, str) or on_write_error not in ("raise", "warn"):
            raise ValueError(f"on_write_error: expected 'raise' or 'warn', got {on_write_error!r}")
        self.dir = Path(record_dir) / f"rank-{rank:05d}"
        self._files: set[str] = set()  # the names of the files this recorder wrote in `dir`
        if self.dir.is_dir() and (found := self._foreign()) is not None:
            raise ValueError(f"record_dir: expected a new folder or one without rank {rank}'s files (a recorded run is "
                             f"never replaced), got {record_dir}, which holds {found}")
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata: expected values that JSON can write (it is stored in every file), got "
                             f"{metadata!r} ({exc})") from None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.metadata, self.on_write_error = rank, dict(metadata or {}), on_write_error
        self._step: int | None = None
        self._written: int | None = None  # the last step written: never written again
        self._calls: list[dict[str, Any]] = []
        self._rollouts: list[tuple[int, Any]] = []  # (step, its table's maker) of the generations not written yet
        self._provenance: dict[str, Any] | None = None
        self._device = torch.device("cpu")  # where the recorded tensors live: the first call's input's device
        # one background thread writes the steps handed off (it ends with the recorder; a pending write ends first)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-core-recorder")
        self._writing: Future | None = None  # the write of the last step handed off
        self._lock: int | None = None  # the descriptor of `dir / LOCK` while this recorder holds it
        self._pid = os.getpid()  # a forked child's copy of the recorder is not its own
        self._flushing = False  # in `flush`: a SIGTERM waits for its end
        self._sigterm = False  # a SIGTERM came during `flush`: raised again at its end

    def record(self, result: GRPOLossResult, *, step: int, input: torch.Tensor, completion_ids: torch.Tensor,
               completion_mask: torch.Tensor, prompt_ids: torch.Tensor | None = None,
               prompt_mask: torch.Tensor | None = None, old_logps: torch.Tensor | None = None,
               ref_logps: torch.Tensor | None = None, importance_sampling_ratio: torch.Tensor | None = None,
               micro_batch: int = 0, generation: int = 0, sequences: tuple[int, int] | None = None,
               layers: dict[str, torch.Tensor] | None = None) -> None:
        """Records one loss call. `input` `[B, T, ...]`: the tensor the loss was called with (hidden states or logits),
        its gradient digested in a hook when a backward runs; `completion_ids` / `completion_mask` `[B, T]`: the
        completion (the mask: the loss's active tokens); `prompt_ids` / `prompt_mask`: the prompt (part of the key).
        `sequences`: `(lo, hi)`, where this rank's B sequences sit in the result's vectors (default: the result covers
        exactly these B sequences, as a call in one process does). `layers`: `{module name: [B, LANES] digests}` in the
        order the modules ran (`grpo_core.digest.module_digests`), recorded as the fields `layer/<place>/<name>`."""
        if not isinstance(result, GRPOLossResult):
            raise ValueError(f"result: expected the GRPOLossResult the loss returned, got {_type_name(result)}")
        for name, t in (("input", input), ("completion_ids", completion_ids), ("completion_mask", completion_mask)):
            check_tensor(name, t)
        for name, t in (("prompt_ids", prompt_ids), ("prompt_mask", prompt_mask), ("old_logps", old_logps),
                        ("ref_logps", ref_logps), ("importance_sampling_ratio", importance_sampling_ratio)):
            check_tensor(name, t, optional=True)
        for name, value in (("step", step), ("micro_batch", micro_batch), ("generation", generation)):
            _check_count(name, value)
        if self._step is not None and step < self._step:
            raise ValueError(f"step: expected at least the last recorded step {self._step}, got {step}")
        if step == self._written:
            raise ValueError(f"step: expected more than {step}, the last written step, got {step} (a written step is "
                             f"never replaced)")
        if completion_mask.dim() != 2:
            raise ValueError(f"completion_mask: expected [B, T], got {list(completion_mask.shape)}")
        mask = completion_mask.bool()
        B, T = mask.shape
        for name, t, shape, dims in (("completion_ids", completion_ids, "[B, T]", 2),
                                     ("input", input, "[B, T, ...]", 2), ("prompt_ids", prompt_ids, "[B, P]", 1)):
            if t is not None and (t.dim() < 2 or t.shape[:dims] != mask.shape[:dims]):
                like = f"[B, T] = {[B, T]}" if dims == 2 else f"B = {B}"
                raise ValueError(f"{name}: expected {shape} with {like} like completion_mask, got {list(t.shape)}")
            if name != "input" and t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                raise ValueError(f"{name}: expected integer token ids, got {t.dtype}")
        if prompt_mask is not None and (prompt_ids is None or prompt_mask.shape != prompt_ids.shape):
            raise ValueError(f"prompt_mask: expected the shape of prompt_ids, "
                             f"{None if prompt_ids is None else list(prompt_ids.shape)}, got {list(prompt_mask.shape)}")
        for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps),
                        ("importance_sampling_ratio", importance_sampling_ratio)):
            ok = [[B, T], [B, 1]] if name == "importance_sampling_ratio" else [[B, T]]
            if t is not None and list(t.shape) not in ok:
                raise ValueError(f"{name}: expected [B, T] = {[B, T]}{' or [B, 1]' if len(ok) > 1 else ''} like "
                                 f"completion_mask, got {list(t.shape)}")
        n = result.per_sequence_policy.shape[0]
        lo, hi = (0, n) if sequences is None else sequences
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 0 <= lo <= hi <= n \
                or hi - lo != B:
            raise ValueError(f"sequences: expected (lo, hi) with hi - lo = {B} sequences of completion_ids and "
                             f"0 <= lo <= hi <= {n} (the result's sequences), got {sequences!r}")
        if layers is not None and (not isinstance(layers, dict) or not all(
                isinstance(k, str) and k and not any(ch.isspace() for ch in k) and isinstance(v, torch.Tensor)
                and v.dtype == torch.int64 and list(v.shape) == [B, LANES] for k, v in layers.items())):
            raise ValueError(f"layers: expected a dict of module names (no spaces) to [B, {LANES}] = {[B, LANES]} int64 "
                             f"digests (grpo_core.digest.module_digests), got " + (
                                 ", ".join(f"{k!r}: {list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
                                           for k, v in layers.items()) if isinstance(layers, dict) else repr(layers)))
        if self._provenance is None:  # before the flush below: a generation's rollout waiting in it carries it too
            self._device, self._provenance = input.device, _provenance(input.device)
        if step != self._step:
            self.flush(wait=False)
            self._step = step
        rows = RowDigests(mask, input.device)
        token_advantages = result.advantages[lo:hi] if result.advantages.dim() == 2 else None
        given = [t.detach().float().expand(B, T) for t in
                 (old_logps, ref_logps, importance_sampling_ratio, token_advantages) if t is not None]
        digests = rows(input, torch.stack(given, -1)) if given else [rows(input)[0], None]  # one matmul
        call: dict[str, Any] = {
            "micro_batch": micro_batch, "generation": generation,
            "keys": (completion_ids.detach(), mask, None if prompt_ids is None else prompt_ids.detach(),
                     None if prompt_mask is None else prompt_mask.detach()),
            "scalars": torch.stack([result.loss.detach(), result.policy_loss, result.kl]).float(),
            "vectors": {f: getattr(result, f)[lo:hi].detach() for f in SEQUENCE_FIELDS
                        if getattr(result, f) is not None and (f != "advantages" or getattr(result, f).dim() == 1)},
            "input_digest": digests[0], "logps_digest": digests[1],
            "layers": [(f"layer/{i:03d}/{name}", d) for i, (name, d) in enumerate((layers or {}).items())]}
        if input.requires_grad and torch.is_grad_enabled():
            def hook(grad: torch.Tensor) -> None:
                call["grad_digest"], call["grad_mantissa_digest"] = rows(grad, mantissas(grad))
                handle.remove()  # this call's backward only: an input used again gets its next call's hook

            handle = input.register_hook(hook)
        self._calls.append(call)
        if self not in _open:
            _register(self)

    def flush(self, *, wait: bool = True) -> Path | None:
        """Writes the calls of the current step to its file (nothing when there is none); returns the file.
        `wait=False` (the trainer's and a new step's first `record`'s): the step's numbers leave the device in one copy
        without a host synchronization and a background thread writes the file; the next `flush` or `close` waits for
        it and raises its error (the step is not written again). With `wait=True` a write error raised leaves the step
        to be flushed again. The first write takes the rank's folder (see `_claim`)."""
        self._flushing = True
        try:
            self._join()
            if not self._calls and not self._rollouts:
                return None
            self._claim()
            rollouts, self._rollouts = [(step, make()) for step, make in self._rollouts], []
            if not self._calls:  # rollouts alone (a generation before its step's first loss call)
                for i, (step, table) in enumerate(rollouts):
                    try:
                        self._save(step, self.dir / f"rollout-{step:07d}.parquet", table)
                    except BaseException:
                        self._rollouts = [(s, lambda t=t: t) for s, t in rollouts[i:]]  # to be flushed again
                        raise
                return None
            path = self.dir / f"step-{self._step:07d}.parquet"
            calls, step = self._calls, self._step
            parts = [(c["keys"], c["scalars"], c["vectors"], [c.get(f) for f in DIGEST_FIELDS],
                      [d for _, d in c["layers"]]) for c in calls]
            host = _HostCopy(_leaves(parts), self._device)
            meta = self._meta("training")
            args = (step, path, [(c["micro_batch"], c["generation"], [f for f, _ in c["layers"]]) for c in calls],
                    parts, host, meta, rollouts)
            if wait:
                try:
                    self._save(*args)  # on an error raised the step stays to be flushed again
                except BaseException:
                    self._rollouts = [(s, lambda t=t: t) for s, t in rollouts if f"rollout-{s:07d}.parquet"
                                      not in self._files] + self._rollouts
                    raise
            else:
                self._writing = self._writer.submit(self._save, *args, background=True)
            self._calls, self._written = [], step
            return path
        finally:
            self._flushing = False
            if self._sigterm:
                self._sigterm = False
                signal.raise_signal(signal.SIGTERM)

    def record_rollout(self, *, step: int, positions: list[int], prompt_ids: list[list[int]],
                       completion_ids: list[list[int]], rewards: np.ndarray, texts: list[str],
                       sampler_logps: list[np.ndarray] | None = None, trainer_logps: list[np.ndarray] | None = None,
                       keys: list[str] | None = None, meta: dict[str, Any] | None = None) -> None:
        """Records what one generation gave this rank's sequences (`grpo_core.rollouts`: the ids, the rewards
        `[n, reward functions]`, the sampler's and the trainer's log-prob of each completion token, the start of each
        completion's text; `meta` beside them), written as `rollout-<step>.parquet` with the next flush. `keys`: the
        sequences' keys when their step rows key them by other ids than these (default: `key_of` these ids)."""
        _check_count("step", step)
        if self._step is not None and step < self._step:
            raise ValueError(f"step: expected at least the last recorded step {self._step}, got {step}")
        n = len(positions)
        for name, value in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids), ("texts", texts)):
            if not isinstance(value, list) or len(value) != n:
                raise ValueError(f"{name}: expected a list of {n} (one per position), got {type(value).__name__} "
                                 f"of {len(value) if hasattr(value, '__len__') else '?'}")
        if np.asarray(rewards).ndim != 2 or len(rewards) != n:
            raise ValueError(f"rewards: expected [{n}, reward functions], got {list(np.shape(rewards))}")
        if keys is None:
            keys = [key_of(p, c) for p, c in zip(prompt_ids, completion_ids)]
        table = functools.partial(rollout_table, step, positions, keys, prompt_ids, completion_ids, rewards,
                                  sampler_logps, trainer_logps, texts)  # checked now; its metadata when written
        table(self._meta("rollout"))
        self._rollouts.append((step, lambda: table({**self._meta("rollout"), **(meta or {})})))
        if self not in _open:
            _register(self)

    def _meta(self, kind: str) -> dict[str, Any]:
        return {"kind": kind, "rank": self.rank, "metadata": self.metadata, "provenance": self._provenance,
                "grpo_core_version": _version(), "sequence_keys": KEY_FORMAT}

    def close(self) -> None:
        """Writes what is left, waits for the file and gives the rank's folder up (call it after the last backward)."""
        self.flush()
        self._release()
        _unregister(self)

    def _foreign(self) -> Path | None:
        """The first file in `dir` that this recorder did not write (hidden ones aside: the lock, a file system's)."""
        return next((p for p in sorted(self.dir.iterdir())
                     if not p.name.startswith(".") and p.name not in self._files), None)

    def _claim(self) -> None:
        """Takes the rank's folder until `close`: an exclusive `flock` of `dir / LOCK` (released by `close` or the end
        of the process), refused in one line when another recorder holds it (in this process or another) or when the
        folder holds a file this one did not write. A refused recorder is not open: the exit does not try again."""
        if self._lock is not None:
            return
        where = f"record_dir: expected no other recorder of rank {self.rank} in {self.dir.parent}"
        while self._lock is None:
            fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                _unregister(self)
                raise ValueError(f"{where} (one recorder writes a rank's files), got {self.dir / LOCK} held by process "
                                 f"{holder}") from None
            try:
                taken = os.stat(self.dir / LOCK).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                taken = False
            if not taken:  # its holder closed and removed it after we opened it: open the new one
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._lock = fd
        if (found := self._foreign()) is not None:
            self._release()
            _unregister(self)
            raise ValueError(f"{where} (a recorded step is never replaced), got {found}, written by another one")

    def _release(self) -> None:
        if self._lock is not None:
            (self.dir / LOCK).unlink(missing_ok=True)  # while held: one who opened it meanwhile opens a new one
            os.close(self._lock)
            self._lock = None

    def _join(self) -> None:
        """Waits for the background write of the last step handed off, and raises its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _finish(self, *, close: bool) -> None:
        """A SIGTERM's or the exit's close, or (`close=False`: an earlier handler runs next and the process may go on)
        the wait for the step handed off, the step being recorded left to record on: what it cannot write is warned of,
        not raised (the exit writes what is left)."""
        try:
            self.close() if close else self._join()
        except Exception as exc:
            warnings.warn(_one_line(exc), RuntimeWarning)

    def _save(self, step: int, path: Path, *args: Any, background: bool = False) -> None:
        """`_write`, its error in one line naming the folder and the step: raised (in the background warned of at once,
        and raised by the next flush or close) or, an OSError with `on_write_error="warn"`, warned of and dropped."""
        try:
            if len(args) == 1:  # a table ready to write (a rollout)
                write_exclusive(args[0], path)
                self._files.add(path.name)
            else:
                self._write(step, path, *args)
            return
        except BaseException as exc:
            lost = f"record_dir: step {step} was not written ({_one_line(exc)}) to {self.dir}"
            error = exc
            if isinstance(exc, FileExistsError):
                error = ValueError(f"record_dir: expected no other recorder of rank {self.rank} in {self.dir.parent} "
                                   f"(a recorded step is never replaced), got {exc.filename}, written by another one")
                lost = str(error)
            elif isinstance(exc, OSError):
                error = OSError(lost)
                error.errno = exc.errno
        goes_on = isinstance(error, OSError) and self.on_write_error == "warn"
        if goes_on or background:
            warnings.warn(f"{lost}; " + ("recording goes on (on_write_error='warn')" if goes_on else
                                         "the next flush or close raises it"), RuntimeWarning)
        if not goes_on:
            raise error from None

    def _write(self, step: int, path: Path, calls: list[tuple[int, int, list[str]]], parts: list, host: _HostCopy,
               meta: dict[str, Any], rollouts: list[tuple[int, Any]]) -> None:
        import pyarrow as pa

        for rollout_step, rollout in rollouts:  # before the step: a run's step file comes after its generation's
            rollout_path = self.dir / f"rollout-{rollout_step:07d}.parquet"
            write_exclusive(rollout, rollout_path)
            self._files.add(rollout_path.name)

        cols: dict[str, list] = {k: [] for k in ("sequence", "field", "value", "bits", "digest", "generation",
                                                 "micro_batch")}

        def add(seqs: list[str], field: str, value: list, bits: list, digest: list, call: tuple[int, int]) -> None:
            for k, v in zip(("sequence", "value", "bits", "digest"), (seqs, value, bits, digest)):
                cols[k] += v
            cols["field"] += [field] * len(seqs)
            cols["micro_batch"] += [call[0]] * len(seqs)
            cols["generation"] += [call[1]] * len(seqs)

        for call, (keys, scalars, vectors, digests, layers) in zip(calls, _rebuild(parts, iter(host.tensors()))):
            seqs, none = sequence_keys(*keys), [None] * len(keys[0])
            for f, v in zip(SCALAR_FIELDS, scalars):
                add([f"rank{self.rank}/micro-batch{call[0]}"], f, [v.item()], [v.view(torch.int32).item()], [None],
                    call)
            for f, t in vectors.items():
                bits = t if f == "per_sequence_active_tokens" else t.view(torch.int32)
                add(seqs, f, [float(v) for v in t.tolist()], bits.tolist(), none, call)
            for f, d in [*zip(DIGEST_FIELDS, digests), *zip(call[2], layers)]:
                if d is not None:
                    add(seqs, f, none, none, _hex(d), call)
        n = len(cols["sequence"])
        table = pa.Table.from_pydict({"step": [step] * n, **cols, "rank": [self.rank] * n, "order": list(range(n))},
                                     schema=schema())
        table = table.replace_schema_metadata({b"grpo_core": json.dumps(meta, sort_keys=True).encode()})
        write_exclusive(table, path)
        self._files.add(path.name)


def schema():
    import pyarrow as pa
    return pa.schema([("step", pa.int64()), ("sequence", pa.string()), ("field", pa.string()),
                      ("value", pa.float64()), ("bits", pa.int64()), ("digest", pa.string()),
                      ("generation", pa.int64()), ("micro_batch", pa.int64()), ("rank", pa.int64()),
                      ("order", pa.int64())])


def _version() -> str:
    from . import __version__
    return __version__
