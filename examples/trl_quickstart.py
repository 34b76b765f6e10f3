"""TRL's GRPO trainer on grpo-core's loss: `GRPOCoreTrainer` takes the arguments of `trl.GRPOTrainer` and computes
the loss with `grpo_core.linear.linear_grpo_loss`, from the last hidden states and the LM head's weight.

    .nox/tests/bin/python examples/trl_quickstart.py --steps 2

Needs TRL and its companions (`pip install ".[trl]"`); `.nox/tests/bin/python`, the interpreter `nox -s tests`
makes, has them. Everything is local and on the CPU: a tiny Llama built from a config (random weights, no
download), a character tokenizer, six prompts and a toy reward. Swap in your model, reward functions and dataset.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")  # read when huggingface_hub is imported: nothing is downloaded
os.environ.setdefault("WANDB_DISABLED", "true")
# TRL 1.16 calls names that transformers 5.24 deprecates (gradient_checkpointing): their warnings, not yours
warnings.filterwarnings("ignore", r"`\w*gradient_checkpointing\w*` is deprecated", FutureWarning)

try:
    import torch
    from datasets import Dataset
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, PrinterCallback
    from trl import GRPOConfig
except ModuleNotFoundError as exc:  # the system python3, or an interpreter without TRL: one line, exit code 2
    print(f"trl_quickstart.py: error: {exc.name}: expected an interpreter with grpo-core's [trl] extra installed, got "
          f"{sys.executable}, which lacks it; use .nox/tests/bin/python (README, Train with TRL)", file=sys.stderr)
    sys.exit(2)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_core.integrations.trl import GRPOCoreTrainer  # noqa: E402


def tiny_model(folder: Path) -> str:
    """A 1-layer Llama (hidden 32) and a tokenizer of one token per character, saved where TRL loads them."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *"abcdefgh", " "])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def reward(completions, **kwargs) -> list[float]:
    """The fraction of a completion's characters that are vowels (a toy: any function of the completions will do)."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def train(steps: int, folder: Path) -> list[dict]:
    """Trains `steps` optimizer steps; returns TRL's logged records (loss, kl, reward, ...), one per step."""
    torch.manual_seed(0)
    model = tiny_model(folder / "model")  # a model name or folder, as trl.GRPOTrainer takes
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    dataset = Dataset.from_dict({"prompt": ["abc", "hag", "bead", "cafe", "dh", "g e"]})
    config = GRPOConfig(output_dir=str(folder / "out"), max_steps=steps, per_device_train_batch_size=4,
                        num_generations=4, max_completion_length=8, beta=0.04, learning_rate=1e-2, logging_steps=1,
                        use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOCoreTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # main() prints one line a step
    trainer.train()
    return [record for record in trainer.state.log_history if "loss" in record]


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit code 2 (argparse prints its whole usage block first)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="trl_quickstart.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: expected an integer >= 1, got {args.steps}")
    with tempfile.TemporaryDirectory() as folder:
        for record in train(args.steps, Path(folder)):
            print(f"step {record['step']}: loss {record['loss']:.4f}, kl {record['kl']:.4f}, "
                  f"reward {record['reward']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
