"""Causal-LM training on fsdpzero: a DeepSpeed config, composed by Hydra, run on FSDP2.

    torchrun --standalone --nproc_per_node=2 recipes/train_lm.py                  # the README run
    torchrun --nproc_per_node=8 recipes/train_lm.py zero=stage2 precision=bf16 optim.lr=3e-4
    python recipes/train_lm.py experiment=smoke                                   # one process
    torchrun ... recipes/train_lm.py ds_config=my_ds.json ds_config.optimizer.params.lr=1e-4

With no arguments: a small Llama (conf/model/tiny_llama.yaml) learns CPython's pydoc_data.topics byte by byte,
ZeRO-3, fp32, 2 ranks (gloo on CPU, NCCL on GPUs). The loop is DeepSpeed's: engine(**batch), engine.backward(loss),
engine.step(). The engine prints the effective config and the key-by-key decision table once at start.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import fsdpzero
from corpus import PackedLMDataset, build_loader
from recipe_utils import (NO_PNG, RecipeError, ds_config_dict, earlier_curve, latest_checkpoint, rank_and_world,
                          run_main, setup_run_dir, write_loss_curve)

log = logging.getLogger("recipe")   # not under "fsdpzero": that logger does not propagate to train.log


def build_model(model_cfg: DictConfig) -> torch.nn.Module:
    """A transformers model from a config node (`_target_` = a transformers *Config class), randomly initialised."""
    from transformers import AutoModelForCausalLM
    try:
        config = instantiate(model_cfg)
        return AutoModelForCausalLM.from_config(config)
    except Exception as e:  # a bad model group is bad input: say which and why, in one line
        cause = e.__cause__ or e
        msg = " ".join(str(cause).split()) or type(cause).__name__
        raise RecipeError(f"model={model_cfg.get('_target_', '?')}: cannot build this model config: {msg}") from None


class TrainLMRecipe:
    """setup -> train -> save -> cleanup, in that order; everything the loop needs is set up front."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.rank, self.local_rank, self.world = rank_and_world()
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.curves: dict[str, list[tuple[int, float]]] = {"train": [], "val": []}
        self.saved_step: int | None = None   # the step of the checkpoint this run wrote last

    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)             # same init on every rank; FSDP2 shards identical weights
        self.train_set = PackedLMDataset(cfg.data.seq_len, "train", cfg.data.val_fraction)
        self.val_set = PackedLMDataset(cfg.data.seq_len, "val", cfg.data.val_fraction)
        model = build_model(cfg.model)
        name, n_params = type(model).__name__, sum(p.numel() for p in model.parameters())
        self.run_dir = setup_run_dir(cfg, self.rank)
        try:
            self.engine, _, _, _ = fsdpzero.initialize(model=model, config=ds_config_dict(cfg),
                                                       tuning=OmegaConf.to_container(cfg.tuning) if cfg.get("tuning")
                                                       else {})
        except (ValueError, NotImplementedError) as e:   # the engine's refusals: unshardable model, unsupported key
            raise RecipeError(f"cannot run this model/config: {e}") from None
        self.micro = self.engine.train_micro_batch_size_per_gpu()
        self.gas = self.engine.gradient_accumulation_steps()
        self.loader = build_loader(self.train_set, self.micro, rank=self.rank, world_size=self.world, seed=cfg.seed)
        self.val_loader = build_loader(self.val_set, self.micro, rank=self.rank, world_size=self.world,
                                       shuffle=False)
        if len(self.loader) == 0:
            raise RecipeError(f"data: {len(self.train_set)} training windows cannot fill one micro-batch of "
                              f"{self.micro} on each of {self.world} ranks; lower data.micro_batch_size")
        self.monitor = self.engine.monitor   # the engine writes lr and train_loss each step
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.start_step = self._maybe_resume()
        if self.rank == 0:
            log.info("model %s: %.2fM parameters; %d training windows of %d tokens; %d ranks on %s",
                     name, n_params / 1e6, len(self.train_set), cfg.data.seq_len, self.world,
                     self.device.type)

    def _maybe_resume(self) -> int:
        resume = str(self.cfg.resume)
        if resume == "never":
            return 0
        src = latest_checkpoint(self.ckpt_dir) if resume == "auto" else Path(resume)
        if src is None:
            return 0
        if resume != "auto" and latest_checkpoint(src) is None:
            raise RecipeError(f"resume={resume}: not a checkpoint directory (no 'latest' file naming a tag)")
        if not hasattr(self.engine, "load_checkpoint"):
            raise RecipeError("resume: this fsdpzero build has no engine.load_checkpoint; use resume=never")
        _, client_state = self.engine.load_checkpoint(str(src))   # the engine logs the line on rank 0
        return int((client_state or {}).get("step", 0))

    def _batches(self, start_step: int):
        """Micro-batches forever, epoch after epoch; a resumed run skips what was already consumed."""
        epoch, skip = divmod(start_step * self.gas, len(self.loader))
        while True:
            self.loader.sampler.set_epoch(epoch)
            for i, batch in enumerate(self.loader):
                if i >= skip:
                    yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            skip, epoch = 0, epoch + 1

    def _mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(t)
            t /= dist.get_world_size()
        return t.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.eval()
        total, n = 0.0, 0
        for i, batch in enumerate(self.val_loader):
            if i >= self.cfg.trainer.eval_batches:
                break
            batch = {k: v.to(self.device) for k, v in batch.items()}
            total += self.engine(**batch).loss.item()
            n += 1
        self.engine.train()
        return self._mean(total / max(n, 1))

    def train(self) -> None:
        tcfg = self.cfg.trainer
        tokens_per_step = self.micro * self.gas * self.world * self.cfg.data.seq_len
        batches = self._batches(self.start_step)
        bar = tqdm(total=tcfg.max_steps, initial=self.start_step, disable=self.rank != 0, desc="train",
                   unit="step", dynamic_ncols=True)
        self.engine.train()
        t_last, steps_since, loss_sum = time.perf_counter(), 0, 0.0
        first = self.start_step + 1   # the first step of the current logging window
        for step in range(self.start_step + 1, tcfg.max_steps + 1):
            for _ in range(self.gas):
                loss = self.engine(**next(batches)).loss
                self.engine.backward(loss)
                self.engine.step()
                loss_sum += loss.item()
            steps_since += 1
            if step % tcfg.log_every == 0 or step == tcfg.max_steps or step == self.start_step + 1:
                # mean over the steps since the last log line and over ranks: a smoother, honest curve
                train_loss = self._mean(loss_sum / (self.gas * steps_since))
                loss_sum = 0.0
                if not math.isfinite(train_loss):
                    raise RuntimeError(f"loss is {train_loss} at step {step}: lower optim.lr or check precision")
                now = time.perf_counter()
                tok_s = steps_since * tokens_per_step / max(now - t_last, 1e-9)
                t_last, steps_since = now, 0
                lr = self.engine.get_lr()[0]
                self.curves["train"].append((step, train_loss))
                # labelled: the engine's steps_per_print line shows one step's loss, this the mean since the last
                window = f"step {step}" if step - first == 0 else f"steps {first}-{step}"
                bar.set_postfix_str(f"loss {train_loss:.3f} (mean of {window}, all ranks), lr {lr:.2e}, "
                                    f"tok/s {tok_s:,.0f}", refresh=False)
                first = step + 1
            if tcfg.eval_every and step % tcfg.eval_every == 0 and step != tcfg.max_steps:
                self._eval_and_log(step)
            if tcfg.save_every and step % tcfg.save_every == 0:
                self.save(step)
            bar.update(1)
        bar.close()
        if self.start_step < tcfg.max_steps:
            self._eval_and_log(tcfg.max_steps)

    def _eval_and_log(self, step: int) -> None:
        val = self.evaluate()
        self.curves["val"].append((step, val))
        self.monitor.write_events([("Train/Samples/eval_loss", val, self.engine.global_samples)])
        if self.rank == 0:
            log.info("step %d: val loss %.4f", step, val)

    def save(self, step: int) -> None:
        if step == self.saved_step:   # save_every hit the last step: already written
            return
        self.saved_step = step
        if hasattr(self.engine, "save_checkpoint"):
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=f"global_step{step}", client_state={"step": step})
        elif self.rank == 0:
            log.warning("this fsdpzero build has no engine.save_checkpoint: no checkpoint written")

    def export_hf(self) -> Path:
        """Full weights in Hugging Face layout (safetensors + config.json), gathered by the engine on rank 0."""
        out = self.run_dir / "hf_model"
        self.engine.save_16bit_model(str(out))
        return out

    def cleanup(self) -> None:
        cfg, steps = self.cfg, self.cfg.trainer.max_steps
        if self.start_step >= steps:
            # a finished run started again: its curve, checkpoint and weights stay as they are
            self.monitor.close()
            if self.rank == 0:
                print(f"nothing to do: {self.run_dir} already holds this configuration's run at step "
                      f"{self.start_step} (trainer.max_steps={steps}); raise trainer.max_steps to train on from "
                      f"its checkpoint, or pass resume=never to start over", flush=True)
            if dist.is_initialized():
                dist.destroy_process_group()
            return
        self.save(steps)
        hf_dir = self.export_hf() if cfg.trainer.export_hf else None
        self.monitor.close()
        if self.rank == 0:
            # a resumed run's curve goes on from the points its earlier legs wrote
            whole = {k: [p for p in earlier_curve(self.run_dir, k) if p[0] <= self.start_step] + pts
                     for k, pts in self.curves.items()}
            curve = write_loss_curve(self.run_dir, whole)
            tr, val = whole["train"], whole["val"]
            first = f"{tr[0][1]:.3f}" if tr else "-"
            last = f"{tr[-1][1]:.3f}" if tr else "-"
            summary = (f"done: {steps} steps on {self.world} rank(s), train loss {first} -> {last}"
                       + (f", val loss {val[-1][1]:.3f}" if val else "")
                       + f"; loss curve {curve}" + ("" if curve.suffix == ".png" else NO_PNG)
                       + (f"; weights {hf_dir}" if hf_dir else ""))
            print(summary, flush=True)   # once, on stdout: the line a script or a user looks for
        if dist.is_initialized():
            dist.destroy_process_group()


def recipe_main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO if rank_and_world()[0] == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    recipe = TrainLMRecipe(cfg)
    recipe.setup()
    # the engine's steps_per_print lines and ours go through tqdm.write, so the bar stays whole
    with logging_redirect_tqdm(loggers=[logging.root, logging.getLogger("fsdpzero")]):
        recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    run_main(recipe_main, "config")
