"""The engine's gradient path for `offload_optimizer.device: nvme`: fsdpzero.offload.path's OffloadGradPath with
fsdpzero.offload.nvme_adam.NVMeAdam as the optimizer (and, with `offload_param: nvme`, each FSDP unit swapped in by
fsdpzero.offload.param_swapper.ParamSwapper while NVMeAdam steps it). Built by OffloadGradPath.build, with the
optimizer of step_optimizer below."""
from __future__ import annotations

import torch

from fsdpzero.checkpoint.stream import streamed, streamed_state
from fsdpzero.offload.nvme_adam import NVMeAdam, state_segments
from fsdpzero.offload.chunks import shard_like, on_stream
from fsdpzero.offload.path import OffloadGradPath
from fsdpzero.dist import local_tensor


class NVMeGradPath(OffloadGradPath):
    """fsdpzero.offload.build's gradient path with NVMeAdam as the optimizer: gradients land where they do for
    `offload_optimizer: cpu` (pinned buffers, or the CPU shards), one NVMeAdam.step() swaps the states through
    per sub-group, then the updated shards go back. Checkpoints have the cpu path's layout, so a run can resume
    from one into the other."""

    on_disk = True

    @classmethod
    def step_optimizer(cls, hyper, masters, plan, knobs):
        """NVMeAdam over the stand-ins: the fp32 masters are written to disk now, while `masters.initial` still
        holds the fp32 weights (the build casts the shards next)."""
        optimizer = NVMeAdam(hyper, offload=plan.offload, initial=masters.initial, tuning=knobs)
        masters.initial.clear()
        return optimizer

    @staticmethod
    def fill_out_buffers(entries) -> None:
        """Nothing: a staged out buffer is the stand-in NVMeAdam steps (prepare.nvme_stand_in), not a copy."""

    def _step_chunks(self, work, factor) -> None:
        swapper = self.param_swapper   # offload_param nvme: each unit is swapped in when its first slice steps
        self.optimizer.before_update = None if swapper is None else (
            lambda p: swapper.step_touch(swapper.index[id(self._unit_of[id(p)])]))
        grads = {}
        for chunk, items in work:
            if chunk.d2h_done is not None:
                chunk.d2h_done.synchronize()
            if chunk.h2d_done is not None:       # last step's H2D must have read the buffers we overwrite
                chunk.h2d_done.synchronize()
            grads.update({id(e.master): grad for e, grad in items})
        self.optimizer.step(grad_scale=factor, grads=grads, hyper=self._hyper)   # this step's lr, not the next
        for chunk, items in work:
            with on_stream(self.h2d):
                for e, _ in items:
                    if not _same_storage(e.master, local_tensor(e.param)):
                        local_tensor(e.param).copy_(e.master, non_blocking=self.h2d is not None)
                if self.h2d is not None and items:
                    chunk.h2d_done = torch.cuda.Event()
                    chunk.h2d_done.record(self.h2d)
            chunk.ready.set()
        if swapper is not None:
            swapper.step_end()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        super().refresh_masters()              # stand-ins <- the model's shards
        if not self._streamed_masters:         # a streamed load already wrote the exact fp32 masters
            self.optimizer.write_masters()     # and on to the fp32 masters on disk

    def _order(self):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        by_stand_in = {id(e.master): e for e in self.entries}
        return params, [by_stand_in[id(p)] for p in params]

    streams_checkpoints = True      # state_dict(streaming=True): fsdpzero.checkpoint.dcp reads it tensor by tensor
    _streamed_masters = False       # a streamed load wrote the disk masters: refresh_masters must keep them

    def state_dict(self, streaming: bool = False) -> dict:
        """streaming: the on-disk states as fsdpzero.checkpoint.stream entries (meta tensors read or written one
        at a time by DCP), not read into memory here."""
        self._join()
        self._params_resident()
        self._streamed_masters = False          # a load that failed half way must not keep refresh_masters off
        saved = None if streaming else self.optimizer.state_dict()      # read back from disk, fp32
        params, entries = self._order()
        state = {}
        for i, (p, e) in enumerate(zip(params, entries)):
            if streaming:   # the step counters live in memory; the rest stays on disk until DCP reaches it
                st = {"step": self.optimizer.state.get(p, {}).get("step", torch.tensor(0.0)),
                      **{k: self._streamed(p, e, k) for k in state_segments(p)}}
            else:
                st = saved["state"].get(i, {})
            tensors = {k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st}
            tensors["master"] = st.get("master", p)     # an fp32 stand-in is its own master
            if streaming and "master" not in st and self._streams_params():   # its shard: on disk too
                tensors["master"] = self.param_swapper.streamed_shard(e.param, torch.float32)
            state[e.name] = {"step": st.get("step", torch.tensor(0.0)),
                             **{k: v if streamed_state(v) else shard_like(e.param, v) for k, v in tensors.items()}}
        groups, at = [], 0
        for g in self.optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [e.name for e in entries[at:at + len(g["params"])]]})
            at += len(g["params"])
        return {"state": state, "param_groups": groups}

    def _streamed(self, p, e, key: str):
        opt = self.optimizer

        def write(value: torch.Tensor) -> None:
            opt.write_state(p, key, value)
            if key == "master":
                self._master_loaded(e, value)
        return streamed(e.param, local_tensor(p).shape, torch.float32, lambda: opt.read_state(p, key), write)

    def _streams_params(self) -> bool:
        """offload_param nvme inside the swapper's lazy(): checkpoints stream the param shards too."""
        return self.param_swapper is not None and self.param_swapper.lazy_depth > 0

    @torch.no_grad()
    def _master_loaded(self, e, master: torch.Tensor) -> None:
        self._streamed_masters = True
        swapper = self.param_swapper
        if swapper is not None and swapper.slot(e.param) is not None:   # the shard follows, resident or not
            k, i = swapper.slot(e.param)
            return swapper.write_shard(k, i, master)
        self._params_resident(dirty=True)
        local_tensor(e.param).copy_(master.view(local_tensor(e.param).shape))   # the device copy follows the master

    @torch.no_grad()
    def _load_streamed(self, sd: dict) -> None:
        """The states came in through DCP already (written to disk entry by entry); what is left: steps, the
        hyperparameters, and any real tensor handed in instead (a master crossed over from model weights)."""
        params, entries = self._order()
        for p, e in zip(params, entries):
            saved = sd["state"].get(e.name)
            if saved is None:
                continue
            self.optimizer.state[p]["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).clone()
            for k in state_segments(p):
                v = saved.get(k)
                if v is None or local_tensor(v).is_meta:           # streamed: on disk already
                    continue
                v = local_tensor(v).float().reshape(local_tensor(p).shape)
                self.optimizer.write_state(p, k, v)
                if k == "master":
                    self._master_loaded(e, v)
        for g, s in zip(self.optimizer.param_groups, sd["param_groups"]):
            g.update({k: v for k, v in s.items() if k != "params"})
        self._streamed_masters = False

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        self._join()
        self._params_resident(dirty=True)
        if any(local_tensor(t).is_meta for st in sd["state"].values() for t in st.values()
               if isinstance(t, torch.Tensor)):
            return self._load_streamed(sd)
        params, entries = self._order()
        state = {}
        for i, (p, e) in enumerate(zip(params, entries)):
            saved = sd["state"].get(e.name)
            if saved is None:
                continue
            # no "master" (a non-offload checkpoint): the model weights just loaded are the masters
            master = local_tensor(saved["master"] if "master" in saved else e.param).float().reshape(p.shape)
            state[i] = {"step": saved["step"].clone(), "exp_avg": local_tensor(saved["exp_avg"]).reshape(p.shape),
                        "exp_avg_sq": local_tensor(saved["exp_avg_sq"]).reshape(p.shape)}
            if p.dtype == torch.float32:
                p.copy_(master)
            else:
                state[i]["master"] = master
            local_tensor(e.param).copy_(master.view(local_tensor(e.param).shape))   # the device copy follows the master
        groups, at = [], 0
        for g, s in zip(self.optimizer.param_groups, sd["param_groups"]):
            groups.append({**{k: v for k, v in s.items() if k != "params"},
                           "params": list(range(at, at + len(g["params"])))})
            at += len(g["params"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def close(self) -> None:
        super().close()
        self.optimizer.close()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """offload_param nvme: the stand-in shares the shard's storage (swapped out, its data_ptr is 0)."""
    return a is b or a.untyped_storage()._cdata == b.untyped_storage()._cdata
