"""The process group, one object per backend: a single process, torchrun's DDP or FSDP, Accelerate. Each says
how the model is sharded and wrapped, how gradients skip a reduction between micro-steps, and how a checkpoint's
model and optimizer state are gathered and restored."""
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed.fsdp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from summarizer.errors import UserError


class SingleProcess:
    """One process: the model as it is; state dicts as PyTorch writes them."""

    def __init__(self, cfg, want_cuda):
        self.rank, self.world_size = 0, 1
        self.device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if want_cuda else "cpu"))

    def close(self, clean):
        pass

    def shard(self, model):
        return model

    def wrap(self, model):
        return model

    def no_sync(self, wrapped, sync):
        return contextlib.nullcontext()

    def training_state(self, model, optimizer):
        """(model, optimizer) state dicts as ckpt.pt keeps them, complete, on rank 0; every rank must call this."""
        return model.state_dict(), optimizer.state_dict()

    def load_optimizer_state(self, model, optimizer, state, path):
        """Load an optimizer state dict saved by training_state."""
        if any(isinstance(key, str) for key in state["state"]):
            raise UserError(f"{path} was written by a run with --backend=fsdp, whose optimizer state another "
                            f"backend cannot load: resume with the backend it was trained with")
        optimizer.load_state_dict(state)
        # load_state_dict keeps CPU tensors of the right dtype as they are: views of the checkpoint's mmap'd
        # pages, which would keep the replaced file's disk space in use until the process ends
        for per_param in optimizer.state.values():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    per_param[key] = value.clone()

    def full_weights(self, model):
        """The model's complete state dict on every rank."""
        return model.state_dict()


class DDP(SingleProcess):
    """torchrun's processes, one per GPU (or gloo on CPU): gradients all-reduced by DistributedDataParallel."""

    def __init__(self, cfg, want_cuda):
        if "RANK" not in os.environ:
            raise UserError(f"backend={cfg.backend} needs torchrun: torchrun --nproc_per_node=N --standalone "
                            f"train.py --backend={cfg.backend}")
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if want_cuda else "gloo", device_id=self.device if want_cuda else None,
                                timeout=datetime.timedelta(seconds=cfg.dist_timeout))

    def close(self, clean):
        if dist.is_initialized():
            if clean:  # no rank tears its connections down while another still uses them
                dist.barrier()
            dist.destroy_process_group()

    def wrap(self, model):
        if self.world_size == 1:
            return model
        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def no_sync(self, wrapped, sync):
        """Skip the gradient reduction on all but the last micro-step of an accumulation."""
        if sync or self.world_size == 1:
            return contextlib.nullcontext()
        return wrapped.no_sync()


class Accelerate(DDP):
    """`accelerate launch`: Accelerate's process group and DDP wrapper; precision and compile stay ours."""

    def __init__(self, cfg, want_cuda):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs
        # Accelerate must not add an autocast or a torch.compile of its own around the model.
        self.accelerator = Accelerator(cpu=not want_cuda, mixed_precision="no", dynamo_backend="no",
                                       kwargs_handlers=[InitProcessGroupKwargs(
                                           timeout=datetime.timedelta(seconds=cfg.dist_timeout))])
        self.rank, self.world_size = self.accelerator.process_index, self.accelerator.num_processes
        self.device = self.accelerator.device

    def close(self, clean):
        self.accelerator.end_training()

    def wrap(self, model):
        return self.accelerator.prepare_model(model)



def reduce_once_bytes(model, world_size, dtype):
    """(held, kept): bytes per rank that reducing gradients once per optimizer step holds between FSDP's
    micro-steps (every weight gathered in `dtype`, an fp32 gradient per trainable parameter), and what FSDP keeps
    anyway (its shards of the fp32 weights and gradients, and AdamW's two moments), from the unsharded model."""
    params = list(model.parameters())  # tied weights once
    gradients = sum(p.nbytes for p in params if p.requires_grad)  # fp32 like the weights, and each AdamW moment
    held = sum(p.numel() for p in params) * dtype.itemsize + gradients
    return held, (sum(p.nbytes for p in params) + 3 * gradients) / world_size


class FSDP(DDP):
    """torchrun's processes with FSDP2's fully_shard: weights, gradients and optimizer state sharded across ranks."""

    def __init__(self, cfg, want_cuda):
        if not hasattr(torch.distributed.fsdp, "fully_shard"):
            raise UserError(f"backend=fsdp needs PyTorch 2.6 or newer (fully_shard), this is {torch.__version__}: "
                            f"upgrade torch, or use backend=ddp")
        super().__init__(cfg, want_cuda)
        self.model = None  # the sharded model, once shard() ran

    def plan(self, reduce_once, dtype, is_main):
        """fsdp_reduce_once (False without accumulation; 'auto': decided by shard) and the compute dtype."""
        self.reduce_once, self.dtype, self.is_main = reduce_once, dtype, is_main

    def shard(self, model):
        """Shard the model in place with fully_shard: one unit per block, then the root (embeddings, ln_f, the tied
        lm_head). Its parameters become fp32 DTensors (build the optimizer after this); with a 16-bit dtype each
        unit is all-gathered in that dtype and its gradients are reduce-scattered in fp32. hidden_states is a
        forward method too (the calibration stage calls it). Decides fsdp_reduce_once='auto'."""
        if self.reduce_once == "auto":
            self.reduce_once = self.reduce_once_fits(model)
        policy = torch.distributed.fsdp.MixedPrecisionPolicy()
        if self.dtype != "float32":
            policy = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=getattr(torch, self.dtype),
                                                                 reduce_dtype=torch.float32)
        for block in model.transformer.h:
            torch.distributed.fsdp.fully_shard(block, mp_policy=policy)
        torch.distributed.fsdp.fully_shard(model, mp_policy=policy)
        torch.distributed.fsdp.register_fsdp_forward_method(model, "hidden_states")
        self.model = model
        return model

    def reduce_once_fits(self, model):
        """Whether every GPU has room for FSDP's shards, AdamW's state and what reducing gradients once per
        optimizer step holds (reduce_once_bytes); activations are not counted. On the CPU, yes. Rank 0 says why
        not."""
        if self.device.type != "cuda":
            return True
        held, kept = reduce_once_bytes(model, self.world_size, getattr(torch, self.dtype))
        total = torch.tensor(torch.cuda.mem_get_info(self.device)[1], device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.MIN)  # all ranks decide alike
        fits = held + kept <= total.item()
        if not fits and self.is_main:
            print(f"FSDP reduce-scatters gradients after every micro-step: reducing once per optimizer step would "
                  f"hold {held / 2**30:.1f} GiB of gathered {self.dtype} weights and fp32 gradients beside "
                  f"{kept / 2**30:.1f} GiB of shards and AdamW state, more than the GPU's "
                  f"{total.item() / 2**30:.1f} GiB (--fsdp_reduce_once=True tries anyway)")
        return fits

    def wrap(self, model):
        return model

    def no_sync(self, wrapped, sync):
        """FSDP reduce-scatters after every micro-step, unless reduce_once (accumulation)."""
        return self.accumulation(sync) if self.reduce_once else contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulation(self, sync):
        """One micro-step with reduce_once: the first forward of an optimizer step gathers the weights, which stay
        gathered until the last backward; gradients accumulate unsharded in fp32 and are reduce-scattered
        (averaged, as DDP's all-reduce) by the last backward only."""
        self.model.set_requires_gradient_sync(sync)
        self.model.set_reshard_after_backward(sync)
        for block in self.model.transformer.h:  # the root unit is never resharded after forward
            block.set_reshard_after_forward(False, recurse=False)
        yield
        if sync:  # evaluation and generation reshard after each forward again
            for block in self.model.transformer.h:
                block.set_reshard_after_forward(True, recurse=False)

    def training_state(self, model, optimizer):
        """Gathered from the shards onto rank 0's CPU ({} elsewhere), the optimizer's keyed by parameter name."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)

    def load_optimizer_state(self, model, optimizer, state, path):
        """Each rank takes its shards of an optimizer state dict saved by training_state."""
        if not any(isinstance(key, str) for key in state["state"]):
            raise UserError(f"{path} was written by a run with another backend, whose optimizer state FSDP cannot "
                            f"load: resume with the backend it was trained with")
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def full_weights(self, model):
        """The model's complete state dict on every rank, all-gathered onto each rank's device."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


BACKENDS = {"none": SingleProcess, "ddp": DDP, "fsdp": FSDP, "accelerate": Accelerate}
