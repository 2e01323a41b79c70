"""Supervised fine-tuning of a local Hugging Face causal LM on fsdpzero, sharded from load.

    torchrun --standalone --nproc_per_node=2 recipes/train_lm.py     # first: writes outputs/train_lm/hf_model
    torchrun --standalone --nproc_per_node=2 recipes/sft_hf.py       # then fine-tune it on instruction data
    torchrun ... recipes/sft_hf.py model.pretrained=/models/my-llama model.tokenizer=/models/my-llama zero=stage2

The model is never whole on any rank: `fsdpzero.hf.from_pretrained` builds it on the meta device, shards it per
the DeepSpeed config and reads each rank's rows from the safetensors files. Loss is on answer tokens only. At the
end a few questions are answered with `fsdpzero.hf.generate` (stage-3 shards, ranks kept in step) and the weights
are exported in Hugging Face layout.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import fsdpzero.hf
from corpus import ByteTokenizer, HFTokenizer, InstructionDataset, build_loader
from recipe_utils import (NO_PNG, RecipeError, ds_config_dict, rank_and_world, run_main, setup_run_dir,
                          write_loss_curve)

log = logging.getLogger("recipe")


class SFTRecipe:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.rank, self.local_rank, self.world = rank_and_world()
        self.curves: dict[str, list[tuple[int, float]]] = {"train": []}

    def setup(self) -> None:
        cfg = self.cfg
        src = Path(cfg.model.pretrained)
        if not (src / "config.json").is_file():
            raise RecipeError(f"model.pretrained={src}: no Hugging Face checkpoint there (config.json + "
                              f"safetensors); run recipes/train_lm.py first, or point at a local model folder")
        self.tok = ByteTokenizer() if cfg.model.tokenizer == "bytes" else HFTokenizer(str(cfg.model.tokenizer))
        torch.manual_seed(cfg.seed)
        self.dataset = InstructionDataset(cfg.data.max_len, tokenizer=self.tok)
        self.run_dir = setup_run_dir(cfg, self.rank)
        try:
            self.engine = fsdpzero.hf.from_pretrained(src, ds_config_dict(cfg),
                                                      attn_implementation=cfg.model.attn_implementation)
        except (ValueError, NotImplementedError, KeyError, FileNotFoundError) as e:
            raise RecipeError(f"cannot load {src} with this config: {e}") from None
        vocab = self.engine.module.config.vocab_size
        if vocab < self.tok.vocab_size:
            raise RecipeError(f"model.tokenizer={cfg.model.tokenizer}: {self.tok.vocab_size} tokens, but the model "
                              f"embeds only {vocab}; use the model's own tokenizer")
        self.micro = self.engine.train_micro_batch_size_per_gpu()
        self.gas = self.engine.gradient_accumulation_steps()
        self.loader = build_loader(self.dataset, self.micro, rank=self.rank, world_size=self.world, seed=cfg.seed)
        if len(self.loader) == 0:
            raise RecipeError(f"data: {len(self.dataset)} examples cannot fill one micro-batch of {self.micro} on "
                              f"each of {self.world} ranks; lower data.micro_batch_size")
        self.monitor = self.engine.monitor   # the engine writes lr and train_loss each step
        self.device = self.engine.device
        if self.rank == 0:
            log.info("fine-tuning %s (%d examples, %d answer tokens) on %d rank(s)", src, len(self.dataset),
                     sum(int((e["labels"] != -100).sum()) for e in self.dataset.examples), self.world)

    def _batches(self):
        epoch = 0
        while True:
            self.loader.sampler.set_epoch(epoch)
            for batch in self.loader:
                yield {k: v.to(self.device) for k, v in batch.items()}
            epoch += 1

    def _mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(t)
            t /= dist.get_world_size()
        return t.item()

    def train(self) -> None:
        tcfg, batches = self.cfg.trainer, self._batches()
        bar = tqdm(total=tcfg.max_steps, disable=self.rank != 0, desc="sft", unit="step", dynamic_ncols=True)
        self.engine.train()
        t_last, since, loss_sum, tokens = time.perf_counter(), 0, 0.0, 0
        for step in range(1, tcfg.max_steps + 1):
            for _ in range(self.gas):
                batch = next(batches)
                loss = self.engine(**batch).loss
                self.engine.backward(loss)
                self.engine.step()
                loss_sum += loss.item()
                tokens += int(batch["attention_mask"].sum()) * self.world
            since += 1
            if step % tcfg.log_every == 0 or step in (1, tcfg.max_steps):
                train_loss = self._mean(loss_sum / (self.gas * since))
                if not math.isfinite(train_loss):
                    raise RuntimeError(f"loss is {train_loss} at step {step}: lower optim.lr or check precision")
                now = time.perf_counter()
                tok_s, t_last, since, loss_sum, tokens = tokens / max(now - t_last, 1e-9), now, 0, 0.0, 0
                lr = self.engine.get_lr()[0]
                self.curves["train"].append((step, train_loss))
                bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
            bar.update(1)
        bar.close()

    def answer(self, topic: str) -> str:
        prompt = torch.tensor([self.tok.encode(InstructionDataset.TEMPLATE.format(name=topic), bos=True)],
                              device=self.device)
        out = fsdpzero.hf.generate(self.engine, prompt, max_new_tokens=self.cfg.trainer.max_new_tokens,
                                   do_sample=False, eos_token_id=self.tok.eos_id, pad_token_id=self.tok.pad_id)
        return self.tok.decode(out[0, prompt.shape[1]:])

    def cleanup(self) -> None:
        cfg = self.cfg
        answers = {t: self.answer(t) for t in cfg.trainer.sample_topics}   # every rank: the forwards are collective
        hf_dir = None
        if cfg.trainer.export_hf:                  # safetensors + config.json, gathered on rank 0 by the engine
            hf_dir = self.run_dir / "hf_model"
            self.engine.save_16bit_model(str(hf_dir))
        self.monitor.close()
        if self.rank == 0:
            for t, a in answers.items():
                log.info("Q: %s\n   A: %r", InstructionDataset.TEMPLATE.format(name=t).strip(), a)
            curve = write_loss_curve(self.run_dir, self.curves)
            tr = self.curves["train"]
            summary = (f"done: {cfg.trainer.max_steps} SFT steps on {self.world} rank(s), answer loss "
                       f"{tr[0][1]:.3f} -> {tr[-1][1]:.3f}; loss curve {curve}"
                       + ("" if curve.suffix == ".png" else NO_PNG)
                       + (f"; weights {hf_dir}" if hf_dir else ""))
            print(summary, flush=True)   # once, on stdout: the line a script or a user looks for
        if dist.is_initialized():
            dist.destroy_process_group()


def recipe_main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO if rank_and_world()[0] == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    recipe = SFTRecipe(cfg)
    recipe.setup()
    with logging_redirect_tqdm(loggers=[logging.root, logging.getLogger("fsdpzero")]):
        recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    run_main(recipe_main, "sft")
