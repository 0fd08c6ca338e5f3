"""The backends: one object each for a single process, torchrun's DDP or FSDP, and Accelerate, that shards, wraps and
gathers the model its way and saves and restores its optimizer; and the process group's start (meet: NCCL's
fallbacks on Kaggle's T4s) and its teardown in an order that cannot deadlock (end_process_group, with a watchdog)."""
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

from command_line import UserError
from summarizer.launch import out_of_memory


def resolve_backend(requested, environ):
    """'auto' picks Accelerate under `accelerate launch`, DDP under torchrun, else a single process."""
    if requested != "auto":
        return requested
    if any(key.startswith("ACCELERATE_") for key in environ):
        return "accelerate"
    return "ddp" if "RANK" in environ and "WORLD_SIZE" in environ else "none"


def accelerate_settings(environ):
    """(mixed_precision, dynamo backend) that `accelerate launch` passes in the environment, lower case; refuses
    the distributed types this trainer does not implement through Accelerate."""
    for key, what in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if environ.get(key, "false").lower() in ("1", "true", "yes"):
            raise UserError(f"the Accelerate config asks for {what}, which this trainer does not run through "
                            f"Accelerate: use `accelerate launch --multi_gpu` (DDP) or torchrun with --backend=fsdp")
    return (environ.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
            environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower())


# ---- the backends ----------------------------------------------------------------------------------------

class SingleProcess:
    """One process: the model as it is; state dicts as PyTorch writes them."""

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
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def shard(self, model):
        return model

    def wrap(self, model):
        return model

    def no_sync(self, wrapped, sync):
        return contextlib.nullcontext()

    # between steps, zero_grad(set_to_none=not keeps_gradients): DDP's buckets are its gradients
    # (gradient_as_bucket_view), and set to None the next backward would allocate a second copy beside them
    keeps_gradients = False

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
        """Skip the gradient reduction on all but the last micro-step of an accumulation."""
        if sync or self.world_size == 1:
            return contextlib.nullcontext()
        return wrapped.no_sync()


def zero_gradients(model):
    """`model` with zero gradients, which DDP with gradient_as_bucket_view=True makes views of its buckets as it is
    built: the first step's backward too accumulates into the buckets, with no second copy."""
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
    """The NCCL variables the config's flags ask for (set only where the environment has none)."""
    return {key: value for key, value, on in (("NCCL_P2P_DISABLE", "1", cfg.nccl_p2p_disable),
                                               ("NCCL_CUMEM_HOST_ENABLE", "0", cfg.nccl_p2p_disable),
                                               ("NCCL_IB_DISABLE", "1", cfg.nccl_ib_disable)) if on}


def next_nccl_setting(environ):
    """The first of NCCL_SETTINGS that `environ` does not already have, or None."""
    return next((s for s in NCCL_SETTINGS if any(environ.get(k) != v for k, v in s.items())), None)


def nccl_in_effect(environ):
    """The NCCL_* variables of `environ`, as KEY=value words."""
    return " ".join(f"{k}={v}" for k, v in sorted(environ.items()) if k.startswith("NCCL_")) or "NCCL's defaults"


def meet(cfg, device, world_size):
    """Start the process group and run one collective within dist_start_timeout seconds: a rank that never arrives
    or a transport that fails stops every rank in one line at start-up; later ones may take dist_timeout each."""
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
            fix = (f" (NCCL ran with {nccl_in_effect(os.environ)}): set "
                   + (" ".join(f"{k}={v}" for k, v in setting.items()) + " in the environment and run again "
                      "(a notebook: os.environ[...] before the training cell); docs/troubleshooting.md"
                      if setting else "see docs/troubleshooting.md (NCCL settings) and run python -m "
                                      "bench.preflight"))
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
    """End the process group in an order that cannot deadlock. A gloo group's destructor joins its worker threads,
    and a worker may need the GIL to drop the last reference to a finished collective's tensors: when a C++ holder
    drops the group's last reference (DDP's Reducer, at the interpreter's exit) the GIL stays held and both wait
    (pytorch/pytorch#56297, #75097). So: whatever still holds the group (the run's DDP module, FSDP's state) is
    collected first, while the group's registry keeps it alive; a clean end meets the other ranks in one blocking
    all-reduce whose tensor stays referenced here until the group is gone (no worker drops its last reference);
    then destroy_process_group drops the group from Python, which releases the GIL while the workers stop. A
    watchdog process bounds the rest of this process's life by TEARDOWN_SECONDS, in case a runtime still hangs.
    After an error (its frames cleared by Runtime), no collection: under torchrun the launcher stops the other ranks
    within moments."""
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
    """A watchdog process that writes `line` and kills this process if it is alive `seconds` from now (a thread
    needs the GIL, which a hung teardown may hold); it learns of our end from a pipe only we write to."""
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
        if dist.is_initialized():  # end_training skips the group under notebook_launcher's forked workers
            end_process_group(self.device, clean, self.rank)

    def wrap(self, model):
        return self.accelerator.prepare_model(zero_gradients(model))


class FSDP(DDP):
    """torchrun's processes with FSDP2's fully_shard: weights, gradients and optimizer state sharded across ranks.
    torch's FSDP modules are imported where used: at the top they cost every process a second of its start-up."""

    def __init__(self, cfg, want_cuda):
        super().__init__(cfg, want_cuda)
        self.model = None  # the sharded model, once shard() ran

    def plan(self, reduce_once, dtype, is_main):
        """fsdp_reduce_once ('auto': decided by shard) and the compute dtype."""
        self.reduce_once, self.dtype, self.is_main = reduce_once, dtype, is_main

    def shard(self, model):
        """Shard the model in place with fully_shard, one unit per block, then the root; its parameters become fp32
        DTensors (build the optimizer after this), gathered in a 16-bit dtype. (memory.workload decides
        fsdp_reduce_once='auto' before.)"""
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
        from torch.distributed.checkpoint import state_dict as dcp
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dcp.get_model_state_dict(model, options=options), dcp.get_optimizer_state_dict(model, optimizer,
                                                                                              options=options)

    def load_optimizer_state(self, model, optimizer, state, path):
        """Each rank takes its shards of an optimizer state dict saved by training_state."""
        if not any(isinstance(key, str) for key in state["state"]):
            raise UserError(f"{path} was written by a run with another backend, whose optimizer state FSDP cannot "
                            f"load: resume with the backend it was trained with")
        from torch.distributed.checkpoint import state_dict as dcp
        dcp.set_optimizer_state_dict(model, optimizer, state, options=dcp.StateDictOptions(full_state_dict=True))

    def full_weights(self, model):
        """The model's complete state dict on every rank, all-gathered onto each rank's device."""
        from torch.distributed.checkpoint import state_dict as dcp
        return dcp.get_model_state_dict(model, options=dcp.StateDictOptions(full_state_dict=True))


BACKENDS = {"none": SingleProcess, "ddp": DDP, "fsdp": FSDP, "accelerate": Accelerate}


# ---- compiling: whether a command compiles, and the training step under torch.compile ----------------------
# (Decoding is not compiled: greedy's steps replay as CUDA graphs, generate.StepGraphs.)

def use_compile(requested, device_type, accelerate_dynamo="no"):
    """The config's `compile`: 'auto' compiles on CUDA only (on CPU a short run spends more time compiling than
    it saves), True and False force it on or off on any device. Under `accelerate launch`, Accelerate's dynamo
    backend 'inductor' turns 'auto' on (we compile, with our trial and fallback); it contradicts compile=False."""
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
    """Whether `error` is the compiler's (dynamo's tracing, inductor's code generation, a missing C++ compiler or
    Triton): only then is running eagerly a fallback. Errors of the program itself, an out-of-memory included
    (also one the compiler wraps), are not: eager would meet them too, needing more memory."""
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
    """AOTAutograd compiles the backward graph at the forward, not lazily at the first backward: a compiler error
    there meets CompiledModule's fallback."""
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


class CompiledModule(torch.nn.Module):
    """`module` under torch.compile (fullgraph; sizes symbolic from the start, as micro-batch widths and target
    counts change every step). Where the compiler fails at a call (a first call, a recompile, its limit): one warning
    line and `module` eagerly for the rest of the run (`why`: the compiler's error in one line; None while compiled).
    Its parameters are `module`'s, so DDP and the optimizer see the same tensors either way."""

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
                self.why = f"{type(error).__name__}: {str(error).strip().partition(chr(10))[0]}"
                tqdm.write(f"warning: torch.compile failed ({self.why}); training eagerly from now on (tokens_per_s "
                           f"and mfu are eager's)", file=sys.stderr)  # a line of its own under a bar
        return self.compiled._orig_mod(*args)
