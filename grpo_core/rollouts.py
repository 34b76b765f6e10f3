"""What one generation gave each sequence, beside the loss's record: for replay, and for the sampler against the
trainer.

`rank-<R>/rollout-<S>.parquet` holds the sequences rank R generated at optimizer step S, one row each, in the order
they were generated:
- `position`: the sequence's place in the generation batch of all ranks (rank R's rows follow ranks 0..R-1's);
- `sequence`: its key (`grpo_core.recorder.sequence_keys`: the same key as its rows in the step files);
- `prompt_ids`, `completion_ids`: the active token ids;
- `rewards`: one float32 per reward function, as the trainer got them;
- `sampler_logps`: the sampler's log-prob of each completion token (float32; null where the sampler gave none);
- `trainer_logps`: the trainer's log-prob of each completion token under the weights that sampled it (null where
  none was computed);
- `text`: the start of the decoded completion, to name the sequence in a report.
The file's metadata holds the reward functions' names and the states of torch's CPU generator and of the device's CUDA
generator after the generation (what a replay restores, so that what follows the generation draws the same numbers;
Python's and numpy's generators are not saved).

Floats are stored as float32 arrays (bits kept, NaN payloads too). Reading needs pyarrow (the `harness` extra).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["ROLLOUT_GLOB", "read_rollouts", "rng_states", "rollout_table", "set_rng_states"]

ROLLOUT_GLOB = "rank-*/rollout-*.parquet"
TEXT_CHARS = 48  # of a completion's decoded text, kept to name it


def rollout_schema():
    import pyarrow as pa
    return pa.schema([("step", pa.int64()), ("position", pa.int64()), ("sequence", pa.string()),
                      ("prompt_ids", pa.list_(pa.int64())), ("completion_ids", pa.list_(pa.int64())),
                      ("rewards", pa.list_(pa.float32())), ("sampler_logps", pa.list_(pa.float32())),
                      ("trainer_logps", pa.list_(pa.float32())), ("text", pa.string())])


def _lists(rows: list[np.ndarray] | None, dtype: str, n: int):
    """A list column from per-row arrays (None: a null column), its values copied bit for bit."""
    import pyarrow as pa
    if rows is None:
        return pa.nulls(n, pa.list_(pa.from_numpy_dtype(np.dtype(dtype))))
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    values = np.concatenate([np.asarray(r, dtype=dtype) for r in rows]) if rows else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def rollout_table(step: int, positions: list[int], keys: list[str], prompt_ids: list[list[int]],
                  completion_ids: list[list[int]], rewards: np.ndarray, sampler_logps: list[np.ndarray] | None,
                  trainer_logps: list[np.ndarray] | None, texts: list[str], meta: dict[str, Any]):
    """One generation of one rank as a table (see the module docstring); `meta` goes into its metadata."""
    import pyarrow as pa
    n = len(positions)
    for name, rows in (("sampler_logps", sampler_logps), ("trainer_logps", trainer_logps)):
        if rows is not None and [len(r) for r in rows] != [len(c) for c in completion_ids]:
            raise ValueError(f"{name}: expected one log-prob per completion token, got lengths "
                             f"{[len(r) for r in rows]} for completions of {[len(c) for c in completion_ids]}")
    columns = [pa.array([step] * n, pa.int64()), pa.array(positions, pa.int64()), pa.array(keys, pa.string()),
               _lists(prompt_ids, "int64", n), _lists(completion_ids, "int64", n),
               _lists([np.asarray(r, np.float32) for r in rewards], "float32", n), _lists(sampler_logps, "float32", n),
               _lists(trainer_logps, "float32", n), pa.array([t[:TEXT_CHARS] for t in texts], pa.string())]
    table = pa.Table.from_arrays(columns, schema=rollout_schema())
    return table.replace_schema_metadata({b"grpo_core": json.dumps(meta, sort_keys=True).encode()})


def read_rollouts(folder: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every rollout file of a recorded run, by step: its rows of all ranks in position order, each row a dict of the
    columns (float lists as float32 numpy arrays) with `rank` and the file's `meta`. `ValueError` (one line) for a
    file that is not a rollout table or two rows of one position."""
    import pyarrow.parquet as pq
    steps: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(folder).glob(ROLLOUT_GLOB)):
        try:
            table = pq.read_table(path)
            meta = json.loads(table.schema.metadata[b"grpo_core"])
        except Exception as exc:  # noqa: BLE001  (any damage: one line naming the file)
            raise ValueError(f"{path}: expected a rollout table written by grpo_core, got an unreadable file "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        if table.schema.remove_metadata() != rollout_schema():
            raise ValueError(f"{path}: expected the columns {rollout_schema().names}, got {table.schema.names}")
        rank = int(path.parent.name.removeprefix("rank-"))
        for row in table.to_pylist():
            for col in ("rewards", "sampler_logps", "trainer_logps"):
                row[col] = None if row[col] is None else np.asarray(row[col], np.float32)
            steps.setdefault(row["step"], []).append({**row, "rank": rank, "meta": meta})
    for step, rows in steps.items():
        rows.sort(key=lambda r: r["position"])
        positions = [r["position"] for r in rows]
        if len(set(positions)) != len(positions):
            raise ValueError(f"{folder}: step {step}: expected each position of the generation batch once, got "
                             f"{len(positions) - len(set(positions))} repeated")
    return steps


def rng_states(device: torch.device) -> dict[str, str]:
    """The CPU generator's state and `device`'s (a CUDA device), base64: what a replay restores after a generation."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}


def set_rng_states(states: dict[str, str], device: torch.device) -> None:
    """Restores what `rng_states` saved (the CUDA state only on a CUDA device)."""
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(states["cpu"]))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(tensor(states["cuda"]), device)
