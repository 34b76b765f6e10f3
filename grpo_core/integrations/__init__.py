"""Integrations with trainers. Each lives in its own module and imports its framework itself, so that
`import grpo_core` never needs one: `grpo_core.integrations.trl` (TRL's `GRPOTrainer`, Liger's fused linear GRPO
loss interface) needs the `trl` extra only for its trainer class."""
