"""GaLore with the Hugging Face Trainer: a tiny Llama on byte-level text, on the CPU in < 1 minute.

    python -m recipes.hf_trainer --steps 100 --rank 16 --out runs/hf_trainer

The text is CPython's own documentation topics (``pydoc_data.topics``, installed with every
CPython), one token per byte. The model is built from a config: nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pydoc_data.topics import topics

import torch
import transformers

from galore2.integrations.transformers import GaLoreTrainer
from recipes.cli import DEBUG_HELP, run_cli

SEQ, EOS = 128, 256  # token ids: the 256 byte values, then an end-of-text id


class ByteText(torch.utils.data.Dataset):
    """``SEQ``-token windows of byte-encoded text; window i starts at ``i * SEQ // 2``."""

    def __init__(self, texts: list[str]) -> None:
        ids = [b for text in texts for b in (*text.encode("utf-8"), EOS)]
        self.ids = torch.tensor(ids, dtype=torch.long)

    def __len__(self) -> int:
        return (len(self.ids) - SEQ) // (SEQ // 2)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * SEQ // 2 : i * SEQ // 2 + SEQ]
        return {"input_ids": window, "labels": window.clone()}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=DEBUG_HELP)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--out", default="runs/hf_trainer", help="Trainer output_dir")
    parser.add_argument("--rank", type=int, default=16, help="GaLore rank")
    args = parser.parse_args(argv)

    texts = [topics[key] for key in sorted(topics)]
    train = ByteText(texts[8:])
    held_out = torch.utils.data.Subset(ByteText(texts[:8]), range(64))  # 8 kB, unseen
    config = transformers.LlamaConfig(
        vocab_size=EOS + 1,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    training = transformers.TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        learning_rate=3e-3,
        weight_decay=0.01,
        warmup_steps=max(1, args.steps // 20),
        lr_scheduler_type="cosine",
        logging_steps=max(1, args.steps // 10),
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = GaLoreTrainer(
        model,
        training,
        train_dataset=train,
        eval_dataset=held_out,
        galore_settings={"rank": args.rank, "update_proj_gap": 50, "scale": 0.25},
    )
    result = trainer.train()
    held_out_loss = trainer.evaluate()["eval_loss"]
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    print(f"final train loss {result.training_loss:.3f} (mean over the run)")
    last = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
    print(f"last logged loss {last:.3f}; held-out loss {held_out_loss:.3f} (uniform: 5.549)")
    print(f"optimizer state bytes {optimizer.state_bytes()}")
    adamw = 2 * 4 * sum(p.numel() for p in model.parameters())  # two fp32 moments
    print(f"(torch.optim.AdamW would hold {adamw} bytes of moments)")
    return held_out_loss


if __name__ == "__main__":
    run_cli(main)
