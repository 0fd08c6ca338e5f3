"""The backends (one process, torchrun's DDP or FSDP, Accelerate), each sharding, wrapping and gathering the model
its way; the process group's start and its teardown in an order that cannot deadlock; the compiled training step."""
import contextlib
import datetime
import gc
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from command_line import UserError, error_line
from summarizer.launch import out_of_memory


def resolve_backend(requested, environ):
    """'auto' picks Accelerate under `accelerate launch`, DDP under torchrun, else a single process."""
    if requested != "auto":
        return requested
    if any(key.startswith("ACCELERATE_") for key in environ):
        return "accelerate"
    return "ddp" if "RANK" in environ and "WORLD_SIZE" in environ else "none"


def accelerate_settings(environ):
    """(mixed_precision, dynamo backend) that `accelerate launch` passes in the environment."""
    for key, what in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if environ.get(key, "false").lower() in ("1", "true", "yes"):
            raise UserError(f"the Accelerate config asks for {what}, which this trainer does not run through "
                            f"Accelerate: use `accelerate launch --multi_gpu` (DDP) or torchrun with --backend=fsdp")
    return (environ.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
            environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower())


class SingleProcess:
    """One process: the model as it is."""

    def __init__(self, cfg, want_cuda):
        self.rank, self.world_size = 0, 1
        self.device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if want_cuda else "cpu"))

    def close(self, clean):
        pass

    # The collectives, of every backend: none in one process (nor in a group of one, which Accelerate may not start)
    def barrier(self):
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_sum(self, tensor):
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather_objects(self, obj):
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def shard(self, model):
        return model

    wrap = shard

    def no_sync(self, wrapped, sync):
        return contextlib.nullcontext()

    # between steps, zero_grad(set_to_none=not keeps_gradients): DDP's buckets are its gradients
    # (gradient_as_bucket_view), and set to None the next backward would allocate a second copy beside them
    keeps_gradients = False

    def training_state(self, model, optimizer):
        """(model, optimizer) state dicts, complete, on rank 0; every rank must call this."""
        return model.state_dict(), optimizer.state_dict()

    def load_optimizer_state(self, model, optimizer, state, path):
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
        meet(cfg, self.device, self.world_size)

    def close(self, clean):
        if dist.is_initialized():
            end_process_group(self.device, clean, self.rank)

    @property
    def keeps_gradients(self):
        return self.world_size > 1

    def wrap(self, model):
        if self.world_size == 1:
            return model
        return DistributedDataParallel(zero_gradients(model), gradient_as_bucket_view=True,
                                       device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def no_sync(self, wrapped, sync):
        return contextlib.nullcontext() if sync or self.world_size == 1 else wrapped.no_sync()


def zero_gradients(model):
    """Gradients there as DDP is built, which makes them views of its buckets: the first backward makes no copy."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return model


# What to set when NCCL's first collective fails, in this order: Kaggle's T4s have no peer access, and NCCL >= 2.24
# sets up its shared-memory transport with cuMem host buffers, which fails there ("Cuda failure 217 'peer access is
# not supported'", NVIDIA/nccl#1838); NCCL_CUMEM_HOST_ENABLE=0 takes the older /dev/shm files (nccl_p2p_disable sets
# it from the start), NCCL_SHM_DISABLE=1 no shared memory at all (a small /dev/shm fails the files too).
NCCL_SETTINGS = ({"NCCL_CUMEM_HOST_ENABLE": "0"}, {"NCCL_SHM_DISABLE": "1"})


def nccl_flags(cfg):
    return {key: value for key, value, on in (("NCCL_P2P_DISABLE", "1", cfg.nccl_p2p_disable),
                                               ("NCCL_CUMEM_HOST_ENABLE", "0", cfg.nccl_p2p_disable),
                                               ("NCCL_IB_DISABLE", "1", cfg.nccl_ib_disable)) if on}


def next_nccl_setting(environ):
    return next((s for s in NCCL_SETTINGS if any(environ.get(k) != v for k, v in s.items())), None)


def nccl_in_effect(environ):
    return " ".join(f"{k}={v}" for k, v in sorted(environ.items()) if k.startswith("NCCL_")) or "NCCL's defaults"


def meet(cfg, device, world_size):
    """Start the process group and run one collective within dist_start_timeout: a failure stops every rank."""
    nccl = device.type == "cuda"
    bound = min((cfg.dist_start_timeout, "dist_start_timeout"), (cfg.dist_timeout, "dist_timeout"))
    start = datetime.timedelta(seconds=bound[0])
    try:
        dist.init_process_group("nccl" if nccl else "gloo", device_id=device if nccl else None, timeout=start)
        dist.all_reduce(torch.ones(1, device=device))
        if nccl:
            torch.cuda.synchronize(device)  # NCCL reports a failed setup at the first wait
    except (RuntimeError, dist.DistError) as e:  # DistStoreError, DistBackendError; NCCL's errors
        detail = " ".join(str(e).split())[:300]
        timed_out = "clients joined" in detail or "timed out" in detail.lower()
        what = (f"the {world_size} processes did not all start and meet within {bound[1]}={bound[0]} s" if timed_out
                else f"the first collective between the {world_size} processes failed")
        fix = ""
        if nccl:
            setting = next_nccl_setting(os.environ)
            fix = f" (NCCL ran with {nccl_in_effect(os.environ)}): " + (
                f"set {' '.join(f'{k}={v}' for k, v in setting.items())} in the environment and run again (a "
                f"notebook: os.environ[...] before the training cell); docs/troubleshooting.md" if setting else
                "see docs/troubleshooting.md (NCCL settings) and run python -m bench.preflight")
        raise UserError(f"{what} ({detail}){fix}") from None
    if bound[0] != cfg.dist_timeout:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=cfg.dist_timeout))


# How long a process may take to end after the ranks' last collective (its outputs are complete by then) before a
# watchdog ends it: destroying a group takes well under a second.
TEARDOWN_SECONDS = 60
WATCHDOG = """
import os, select, signal, sys
pipe, parent, seconds, line = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if not select.select([pipe], [], [], seconds)[0]:  # the pipe is readable (at its end) once the parent has exited
    print(line, file=sys.stderr, flush=True)
    os.kill(parent, signal.SIGKILL)
"""


def end_process_group(device, clean, rank):
    """A gloo group's destructor joins its workers, which may need the GIL that a C++ holder dropping the group's last
    reference (DDP's Reducer, at exit) keeps: both wait (pytorch/pytorch#56297). So what holds the group is collected
    first, a clean end meets the other ranks in one all-reduce whose tensor stays referenced until the group is gone,
    and destroy_process_group drops it from Python, which releases the GIL; a watchdog bounds the rest."""
    if clean:  # no rank tears its connections down while another still uses them
        gc.collect()  # reference cycles through the model and its hooks
        done = torch.ones(1, device=device)
        dist.all_reduce(done)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    watch_exit(TEARDOWN_SECONDS, f"warning (rank {rank}): the process group's teardown did not end within "
                                 f"{TEARDOWN_SECONDS} s of the ranks' last collective; the outputs are complete: "
                                 f"ending the process")
    dist.destroy_process_group()


def watch_exit(seconds, line):
    """A process (not a thread: a hung teardown may hold the GIL) that kills this one, saying `line`, in `seconds`."""
    read, write = os.pipe()  # not inherited by later children (PEP 446): only this process holds `write`
    subprocess.Popen([sys.executable, "-S", "-c", WATCHDOG, str(read), str(os.getpid()), str(seconds), line],
                     pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    os.close(read)


class Accelerate(DDP):
    """`accelerate launch`: Accelerate's process group and DDP wrapper; precision and compile stay ours."""

    def __init__(self, cfg, want_cuda):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
        # Accelerate must not add an autocast or a torch.compile of its own around the model; its DDP's buckets are the
        # gradients, as ours (DDP.keeps_gradients).
        self.accelerator = Accelerator(cpu=not want_cuda, mixed_precision="no", dynamo_backend="no",
                                       kwargs_handlers=[InitProcessGroupKwargs(
                                           timeout=datetime.timedelta(seconds=cfg.dist_timeout)),
                                           DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
        self.rank, self.world_size = self.accelerator.process_index, self.accelerator.num_processes
        self.device = self.accelerator.device

    def close(self, clean):
        self.accelerator.free_memory()  # it keeps the models it prepared: its DDP module holds the group
        super().close(clean)  # a group there: end_training skips it under notebook_launcher's forked workers

    def wrap(self, model):
        return self.accelerator.prepare_model(zero_gradients(model))


class FSDP(DDP):
    """torchrun's processes with FSDP2's fully_shard (imported where used: a second of every process's start-up)."""

    def __init__(self, cfg, want_cuda):
        super().__init__(cfg, want_cuda)
        self.model = None  # the sharded model, once shard() ran

    def plan(self, reduce_once, dtype, is_main):
        self.reduce_once, self.dtype, self.is_main = reduce_once, dtype, is_main

    def shard(self, model):
        """In place, one unit per block, then the root: fp32 DTensors (build the optimizer after)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy()
        if self.dtype != "float32":
            policy = MixedPrecisionPolicy(param_dtype=getattr(torch, self.dtype), reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        self.model = model
        return model

    keeps_gradients = False

    def close(self, clean):
        self.model = None  # the sharded model holds the group: it goes first
        super().close(clean)

    wrap = SingleProcess.shard

    def no_sync(self, wrapped, sync):
        return self.accumulation(sync) if self.reduce_once else contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulation(self, sync):
        """reduce_once: the weights stay gathered from a step's first forward to its last backward, and gradients
        accumulate unsharded in fp32 until that backward reduce-scatters them."""
        self.model.set_requires_gradient_sync(sync)
        self.model.set_reshard_after_backward(sync)
        for block in self.model.transformer.h:  # the root unit is never resharded after forward
            block.set_reshard_after_forward(False, recurse=False)
        yield
        if sync:  # evaluation and generation reshard after each forward again
            for block in self.model.transformer.h:
                block.set_reshard_after_forward(True, recurse=False)

    def training_state(self, model, optimizer):
        """Gathered onto rank 0's CPU ({} elsewhere), the optimizer's keyed by parameter name."""
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dcp.get_model_state_dict(model, options=options), dcp.get_optimizer_state_dict(model, optimizer,
                                                                                              options=options)

    def load_optimizer_state(self, model, optimizer, state, path):
        if not any(isinstance(key, str) for key in state["state"]):
            raise UserError(f"{path} was written by a run with another backend, whose optimizer state FSDP cannot "
                            f"load: resume with the backend it was trained with")
        from torch.distributed.checkpoint import state_dict as dcp
        dcp.set_optimizer_state_dict(model, optimizer, state, options=dcp.StateDictOptions(full_state_dict=True))

    def full_weights(self, model):
        from torch.distributed.checkpoint import state_dict as dcp
        return dcp.get_model_state_dict(model, options=dcp.StateDictOptions(full_state_dict=True))


BACKENDS = {"none": SingleProcess, "ddp": DDP, "fsdp": FSDP, "accelerate": Accelerate}


# ---- the training step compiled (decoding is not: greedy's steps replay as CUDA graphs, generate.StepGraphs) ----

def use_compile(requested, device_type, accelerate_dynamo="no"):
    """'auto' compiles on CUDA only (on CPU a short run spends more compiling than it saves), or as Accelerate asks."""
    if accelerate_dynamo not in ("no", "inductor"):
        raise UserError(f"Accelerate's dynamo_backend={accelerate_dynamo} is not supported: this trainer compiles with "
                        f"inductor (--compile=True); set accelerate's dynamo_backend to no or inductor")
    if accelerate_dynamo == "inductor":
        if requested is False:
            raise UserError(f"--compile=False disagrees with Accelerate's dynamo_backend={accelerate_dynamo} (from "
                            f"accelerate config, --dynamo_backend or ACCELERATE_DYNAMO_BACKEND): drop one of them")
        return True
    return requested is True or (requested == "auto" and device_type == "cuda")


def compiler_error(error):
    """Whether `error` is the compiler's: only then is eager a fallback (it would meet the program's own errors)."""
    import torch._inductor.exc as inductor  # loaded only when something failed

    causes = (error, getattr(error, "inner_exception", None), error.__cause__, error.__context__)
    if any(out_of_memory(e) for e in causes):
        return False
    compiler = tuple(getattr(inductor, name) for name in ("InductorError", "CppCompileError", "InvalidCxxCompiler",
                                                         "CUDACompileError", "LoweringException")
                     if hasattr(inductor, name))
    # fullgraph=True turns dynamo's recompile limit into an error that is not a TorchDynamoException
    return isinstance(error, (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit,
                              *compiler))


def backward_compiled_in_forward():
    """The backward graph compiled at the forward, not lazily: its compiler error meets CompiledModule's fallback."""
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


class CompiledModule(torch.nn.Module):
    """`module` under torch.compile (sizes symbolic: widths change every step); where the compiler fails, one warning
    and `module` eagerly for the rest of the run (`why`). The parameters are `module`'s either way."""

    def __init__(self, module):
        super().__init__()
        self.compiled, self.why = torch.compile(module, fullgraph=True, dynamic=True), None

    def forward(self, *args):
        if self.why is None:
            try:
                with backward_compiled_in_forward():
                    return self.compiled(*args)
            except Exception as e:  # a failed compile ran nothing: the eager call below does the whole work
                if not compiler_error(e):
                    raise
                error = getattr(e, "inner_exception", None) or e  # dynamo wraps the backend's exception
                self.why = error_line(error)
                tqdm.write(f"warning: torch.compile failed ({self.why}); training eagerly from now on (tokens_per_s "
                           f"and mfu are eager's)", file=sys.stderr)  # a line of its own under a bar
        return self.compiled._orig_mod(*args)
