"""Launching: the one-line ending of a command (user errors, out of memory, a crash of one rank of a distributed
job), training from a notebook cell in one process per GPU, and the process's age (max_time counts from it)."""
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch

from command_line import DiskFull, UserError
from config import load_config
from summarizer import run_folder
from summarizer.checkpoint import intact_in

FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # a run saves ckpt.pt after the step in progress and stops


class StopSignals:
    """While inside (`with`, in the main thread: elsewhere a signal cannot be caught), SIGINT (Ctrl-C, a notebook's
    stop button) and SIGTERM (a session or job ending) stop the run: in start-up at once (one `interrupted` line);
    in training(next_step) after step `stop_after` = next_step() (the loop's count), which notice(step) announces
    (None: rank > 0), and alone a second Ctrl-C ends it at once whatever it does, saying at_once() (what is saved);
    after training quietly, under torchrun until the process ends when an error leaves (the launcher's SIGTERM must
    not end it before its line)."""

    def __init__(self, notice, at_once, distributed):
        self.notice, self.at_once, self.distributed = notice, at_once, distributed
        self.received, self.previous, self.phase, self.wakeup = None, {}, "start-up", None
        self.next_step, self.stop_after = None, None  # next_step(): where a signal now stops; the received one's

    @contextlib.contextmanager
    def training(self, next_step):
        self.phase, self.next_step = "training", next_step
        try:
            yield
        finally:
            self.phase, self.next_step = "ended", None  # it holds the loop, whose model must go before the backend

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
            if not self.distributed:
                read, write = os.pipe()
                os.set_blocking(write, False)
                self.wakeup = signal.set_wakeup_fd(write)
                threading.Thread(target=self.second_ctrl_c, args=(read,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None and self.distributed:
            return
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.wakeup is not None:
            os.close(signal.set_wakeup_fd(self.wakeup))  # the watching thread reads its end and ends

    def handle(self, signum, frame):
        if self.phase == "start-up":
            raise KeyboardInterrupt
        if self.received is None:
            self.received, self.stop_after = signum, self.next_step() if self.phase == "training" else None
            if line := self.notice and self.phase == "training" and self.notice(self.stop_after):
                print(f"\n{signal.Signals(signum).name}: {line}", file=sys.stderr, flush=True)

    def second_ctrl_c(self, fd):
        """The wakeup fd hears each signal, here: handle() runs between the main thread's bytecodes only, which a C
        call (a backward, a save) holds off for seconds, and there two signals count once."""
        with os.fdopen(fd, "rb", buffering=0) as heard:
            count = 0
            while byte := heard.read(1):
                count += byte[0] in STOP_SIGNALS
                if count > 1 and byte[0] == signal.SIGINT:
                    print(f"\nsecond Ctrl-C: stopping at once; {self.at_once()}", file=sys.stderr, flush=True)
                    os._exit(128 + signal.SIGINT)


@contextlib.contextmanager
def one_line_errors():
    """For entry points: a UserError is one `error: ...` line (exit 2), an out-of-memory one line too (exit 1),
    Ctrl-C one `interrupted` line (exit 130); under torchrun the line names the rank."""
    rank = os.environ.get("RANK")
    where = f" (rank {rank})" if rank else ""
    try:
        yield
    except UserError as e:
        print(f"error{where}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"interrupted{where}", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Exception as e:
        if not out_of_memory(e):
            raise
        print(f"error{where}: {str(e).strip().partition(chr(10))[0]}", file=sys.stderr)
        sys.exit(1)


@contextlib.contextmanager
def error_lines(out_dir):
    """An error that no other handler names ends in one line, naming the rank under torchrun (among the launcher's
    report and the other ranks' errors, the root cause): its type and first line, and the file of out_dir its
    traceback is appended to (on stderr where that cannot be written)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, UserError) or out_of_memory(e):
            raise
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank else ""
        if FORKED_CUDA in str(e):  # notebook_launcher's forked workers (accelerate issue 3524)
            print(f"error{where}: CUDA cannot start in a process forked from this notebook: train with the "
                  f"notebook's torchrun cell (python -m torch.distributed.run ... train.py) instead of "
                  f"notebook_main", file=sys.stderr)
            sys.exit(1)
        log = os.path.join(out_dir, run_folder.ERROR_LOG)
        try:
            with open(log, "a") as f:  # one write: ranks append to one file
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}{where}:\n{traceback.format_exc()}\n")
            kept = f" (traceback in {log})"
        except OSError:
            traceback.print_exc()
            kept = ""
        # under torchrun on a line of its own, whatever another rank's progress bar left unended
        print(f"{chr(10) * bool(rank)}error{where}: {type(e).__name__}: {str(e).strip().partition(chr(10))[0]}{kept}",
              file=sys.stderr)
        sys.exit(1)


@contextlib.contextmanager
def quiet_launcher_logs():
    """Silence torch.distributed.elastic's loggers: when a worker fails they log the launcher's own traceback,
    while the worker has already printed the error that matters."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def full_disk_keeps_checkpoints(folder):
    """A DiskFull in the body ends in its line plus the checkpoints of the run's `folder` that are intact and how
    to go on from them."""
    try:
        yield
    except DiskFull as e:
        intact = intact_in(folder)
        kept = f"intact: {', '.join(intact)}: {run_folder.GO_ON}" if intact else "no checkpoint was written yet"
        raise DiskFull(f"{e}; {kept}") from None


@contextlib.contextmanager
def lost_rank_keeps_checkpoints(folder, go_on, distributed):
    """In a run of several processes, a collective that fails because another rank is gone (killed, crashed, out of
    memory) ends in one line: what failed, the checkpoints of the run's `folder` that are intact, and `go_on`, the
    command that continues it from folder's ckpt.pt (where there is one)."""
    try:
        yield
    except Exception as e:
        # torch.distributed's error types (NCCL's, the store's); gloo's errors are plain RuntimeErrors whose first
        # line is the source location in its transport: "[.../gloo/transport/tcp/pair.cc:537] Read error ..."
        if not distributed or not (isinstance(e, torch.distributed.DistError) or (
                type(e) is RuntimeError and "/gloo/transport/" in str(e).partition("\n")[0])):
            raise
        intact = intact_in(folder)
        resumable = any(path.startswith(f"{os.path.join(folder, run_folder.CKPT)} (") for path in intact)
        kept = (f"intact: {', '.join(intact)}" if intact else "no checkpoint was written yet") + (
            f"; continue with: {go_on}" if resumable else ": start the run again")
        raise UserError(f"another rank of this run is gone ({type(e).__name__}: "
                        f"{str(e).strip().partition(chr(10))[0]}); {kept}") from None


def notebook_launch(main, argv, num_processes, port):
    """Run main(argv + --backend=accelerate) in `num_processes` processes forked by Accelerate's notebook_launcher,
    one per GPU (nothing in the notebook may have used CUDA before). Errors end in one line (exit 2)."""
    try:
        load_config(argv)  # a mistake in the arguments ends here, before any process starts
        if torch.cuda.is_initialized():
            raise UserError("CUDA was already initialised in this notebook (a cell used the GPU), and processes "
                            "forked from it cannot use CUDA: restart the kernel and call notebook_main first")
        launch_workers(main, argv, num_processes, port)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def launch_workers(main, argv, num_processes, port):
    from accelerate import notebook_launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    try:
        with quiet_launcher_logs():
            notebook_launcher(main, ([*argv, "--backend=accelerate"],), num_processes=num_processes,
                              use_port=str(port))
    except torch.distributed.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise UserError(f"port {port} is in use, probably by the processes of an earlier launch that are "
                        f"still running: restart the kernel, or pass port=<another port>") from None
    except ChildFailedError as e:  # each worker printed its own one-line error above
        if all(failure.exitcode == 2 for failure in e.failures.values()):
            sys.exit(2)  # a user error: nothing to add to the workers' lines
        failed = ", ".join(str(rank) for rank in sorted(e.failures))
        raise UserError(f"training failed in rank(s) {failed}: see the error line(s) above") from None
    except (ValueError, RuntimeError) as e:  # Accelerate's own checks of the notebook's state
        if not any(s in str(e) for s in ("should only be initialized inside", "has been initialized before")):
            raise
        raise UserError(f"{str(e).splitlines()[0]} (restart the kernel and call notebook_main first)") from None


def process_age():
    """Seconds since this process started (Linux's /proc), or 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: start, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def out_of_memory(error):
    """Whether `error` is an allocation failure, a GPU's or the host's (a CPU's or host RAM's, e.g. under `ulimit -v`:
    torch's CPU allocator raises a plain RuntimeError): the one rule of every place that handles one."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: " in str(error))


@contextlib.contextmanager
def out_of_memory_hint(doing, settings):
    """Re-raise an out-of-memory error inside as a torch.OutOfMemoryError whose message is one line: what ran out of
    memory and the settings to lower (entry points print it as `error: ...`)."""
    try:
        yield
    except Exception as e:
        if not out_of_memory(e) or str(e).startswith("out of memory while"):  # already said by an inner hint
            raise
        detail = str(e).strip().partition("\n")[0]
        raise torch.OutOfMemoryError(f"out of memory while {doing}: lower {settings}"
                                     + (f" ({detail})" if detail else "")) from None


def training_memory_hint(cfg, rt):
    """What an out-of-memory while training says to lower (one generating summaries names gen_batch_size)."""
    n, reduce_once = cfg.micro_batch_size, getattr(rt.parallel, "reduce_once", False)
    model = "--n_layer, --n_embd" if cfg.init_from == "scratch" else f"--init_from, now {cfg.init_from}"
    lower = (f"--micro_batch_size (now {n}; batch_size stays, with more accumulation steps)" if n > 1 else
             f"--block_size (now {cfg.block_size}) or the model's size ({model})"  # one row: what is left
             + ("" if cfg.lora_rank else " or set --lora_rank=8 (train adapters only)"))
    return out_of_memory_hint(f"training on micro-batches of {n} sequence{'s' * (n > 1)}", lower
                              + ("" if cfg.gradient_checkpointing else " or set --gradient_checkpointing=True")
                              + (" or set --fsdp_reduce_once=False (it keeps the weights gathered and the "
                                 "gradients unsharded)" if reduce_once is True else ""))
