"""A recorded GRPOCoreTrainer run of the tiny model whose completions do not depend on the process count: the run of
`tests/test_trl_record.py` on one process and, started by torchrun, on two (gloo on the CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/trl_world.py MODEL_DIR OUT_DIR RECORD_DIR PER_DEVICE

TRL samples completions from the process's own random stream, so two processes would sample other completions than
one: `CannedTrainer` draws each completion from a generator seeded by its prompt, its copy within the prompt's
group and the optimizer step, and the same (prompt, completion) pairs reach the loss whatever the layout.
"""

from __future__ import annotations

import collections
import hashlib
import os
import sys

import torch

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("WANDB_DISABLED", "true")

from grpo_core.integrations.trl import GRPOCoreTrainer  # noqa: E402


class CannedTrainer(GRPOCoreTrainer):
    """Completions of 1 to `max_completion_length` tokens from a generator seeded by (prompt, copy, step); a
    completion shorter than the limit ends in EOS."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        copies, out = collections.Counter(), []
        vocab, eos, limit = self.model.config.vocab_size, self.eos_token_ids[0], self.max_completion_length
        for ids in prompt_ids:
            seed = hashlib.sha256(repr((list(ids), copies[tuple(ids)], self.state.global_step)).encode()).digest()
            copies[tuple(ids)] += 1
            g = torch.Generator().manual_seed(int.from_bytes(seed[:7], "little"))
            n = int(torch.randint(1, limit + 1, (1,), generator=g))
            tokens = torch.randint(3, vocab, (n,), generator=g).tolist()  # 0-2: pad, eos, unk
            if n < limit:
                tokens[-1] = eos
            out.append(tokens)
        return out, None


def main(model_dir: str, out_dir: str, record_dir: str, per_device: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_trl import make_trainer  # the tests' run shape

    torch.set_num_threads(1)
    trainer = make_trainer(model_dir, out_dir, lambda **kw: CannedTrainer(record_dir=record_dir, **kw),
                           loss_type="grpo", beta=0.04, per_device_train_batch_size=per_device)
    # each process's loss checks its values in the call when DDP would average a bad one into the others' gradients
    many = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    assert trainer.grpo_core_loss.check_values == ("sync" if many else "deferred"), trainer.grpo_core_loss.check_values
    trainer.train()  # the recorder's files are written when it returns
    if torch.distributed.is_initialized():
        # Every rank done, then out without tearing gloo down: `destroy_process_group` joins gloo's loop thread
        # holding the GIL, and that thread can be freeing a finished collective's tensors, which needs the GIL (a
        # deadlock seen on a loaded 2-core machine); the interpreter's own exit with gloo's threads alive can crash.
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
