"""A checkpoint: its record (what best.pt and ckpt.pt hold, a typed dict with a format version: written by
TrainingState.save, read by load_checkpoint, which upgrades the files of every earlier version step by step), its
file format (torch.save written atomically, read back with weights_only so a file cannot run code, a damaged file
named with the intact ones beside it) and the training state a resumed run restores (TrainingState)."""
import contextlib
import glob
import math
import os
import zipfile
from dataclasses import asdict, dataclass, field
from typing import TypedDict

import torch

import data
from config import FIELDS, AdamW, ModelShape, keys, typed
from summarizer import lora, run_folder
from summarizer.errors import DiskFull, UserError
from summarizer.files import atomic_write
from summarizer.schedule import describe_schedule, lr_schedule, resumed_schedule

# ---- the record --------------------------------------------------------------------------------------------

# What TrainingState.save writes; load_checkpoint reads 1 to FORMAT (FORMATS). A change of what a checkpoint's
# contents mean bumps it (a new setting only needs its entry in ABSENT), with its upgrade step (UPGRADES, ADDED) and a
# fixture written by the last commit of the format before (tests/fixtures/checkpoints/make.sh):
# tests/test_checkpoint_formats.py reads every fixture.
FORMAT = 5
FORMATS = {1: "the version of 2026-11-23", 2: "the version of 2026-11-24", 3: "the version of 2026-11-25",
           4: "the version of 2026-11-26 up to f63e9be", 5: "this version"}


class Record(TypedDict):
    """What every checkpoint says of its run, and its weights (best.pt holds no more)."""
    format: int
    model_args: dict  # the model's GPTConfig
    config: dict  # every setting of the run, config.Config's keys and types (the shape keys: the model's)
    tokenizer: str  # data.TOKENIZER_ID of the BPE its token ids mean
    iter_num: int  # optimizer steps done
    best_metric: str
    best_score: float | None  # the best evaluation's best_metric (a loss as it is: lower is better)
    best_val_loss: float | None  # the best evaluation's val_loss, which breaks a ROUGE tie
    metrics: dict  # the last evaluation's
    train_rows: dict | None  # data.Examples.fingerprints() of the training rows; None: format 1 kept none
    validation_digest: str | None  # None: format 1 kept none
    model: dict  # the state dict (a LoRA ckpt.pt: its adapters alone)


class Checkpoint(Record, total=False):
    """ckpt.pt: the record, what a resume needs, and a stage's own keys (calibration's `candidates`)."""
    lora_base: dict | None  # a LoRA run: where its frozen base comes from and its hash, instead of its weights
    optimizer: dict
    scaler: dict  # {} without fp16
    rng: list  # each rank's
    schedule: dict  # summarizer.schedule's
    skipped_steps: int


def shape_settings(model_args):
    """The settings a model's GPTConfig (model_args) fixes: ModelShape's keys and block_size."""
    return {key: model_args[key] for key in (*keys(ModelShape), "block_size")}


def format_of(ckpt):
    """The format of a checkpoint dict: its `format`, else told by the keys each version added."""
    if "format" in ckpt:
        return ckpt["format"]
    return 3 if "best_val_loss" in ckpt else 2 if "tokenizer" in ckpt else 1


# Settings added in each format, with the value a run of the format before had in effect: a checkpoint's config
# gets them as it is upgraded (format 1 lacked every key of ADDED[2], ...). Where a setting's absence meant "off"
# or "none", that is the value.
ADDED = {
    2: {"resume_from": "", "max_time": "", "fsdp_reduce_once": False, "gen_memory_gb": 0.0, "rank_weight": 0.0,
        "rank_margin": 0.01, "rank_length_exponent": 1.0, "rank_candidates": 8, "rank_decoding": "beam",
        "candidates_file": ""},  # nccl_ib_disable: see upgrade_1
    3: {"compare": ""},
    4: {"output_quota_dir": "", "output_quota_gb": 20.0},  # no quota was counted
    5: {"dist_start_timeout": 1800},  # the ranks met within dist_timeout (its default)
}


def upgrade_1(ckpt):
    """Format 1 (2026-11-23) -> 2: GPT-2's BPE was the only tokenizer, so its ids are today's; best_score was kept
    negated for val_loss (higher was better), best_metric only in the config; no fingerprints of the training and
    validation rows; one flag, nccl_p2p_disable, also set NCCL_IB_DISABLE."""
    config = {**ADDED[2], "nccl_ib_disable": ckpt["config"]["nccl_p2p_disable"], **ckpt["config"]}
    metric, score = config["best_metric"], ckpt["best_score"]
    return {**ckpt, "format": 2, "config": config, "tokenizer": data.TOKENIZER_ID, "best_metric": metric,
            "best_score": -score if metric == "val_loss" and score is not None else score,
            "train_rows": None, "validation_digest": None}


def upgrade_2(ckpt):
    """Format 2 (2026-11-24) -> 3: no best_val_loss (a ROUGE tie went to the later evaluation); every ckpt.pt had a
    `candidates` key, None outside the calibration stage."""
    upgraded = {**ckpt, "format": 3, "config": {**ADDED[3], **ckpt["config"]}, "best_val_loss": None}
    if upgraded.get("candidates", 0) is None:
        del upgraded["candidates"]
    return upgraded


def upgrade_3(ckpt):
    """Format 3 (2026-11-25) -> 4: settings kept as text are typed (max_time in seconds, lora_targets a tuple,
    sweep a mapping), and the shape keys of the config are the model's (a pretrained model's config kept the
    defaults of init_from=scratch)."""
    config = {**ADDED[4], **ckpt["config"], **shape_settings(ckpt["model_args"])}
    return {**ckpt, "format": 4, "config": {key: typed(key, value, "the checkpoint's config")
                                             for key, value in config.items() if key in FIELDS}}


def upgrade_4(ckpt):
    """Format 4 (2026-11-26, up to f63e9be) -> 5: no dist_start_timeout."""
    return {**ckpt, "format": 5, "config": {**ADDED[5], **ckpt["config"]}}


UPGRADES = {1: upgrade_1, 2: upgrade_2, 3: upgrade_3, 4: upgrade_4}

# Settings added since format 5, with the value in effect before each existed: a checkpoint that lacks one gets it
# as it loads. A new setting needs no new format; a format changes when a meaning does.
ABSENT = {"sessions": 1}


def upgraded(ckpt, path):
    """A checkpoint dict of any format, as format FORMAT; one line for a file this code cannot read."""
    version = format_of(ckpt)
    if not isinstance(version, int) or version > FORMAT:
        raise UserError(f"{path} is a checkpoint of format {version}, written by a newer version of this program "
                        f"than this one (formats 1 to {FORMAT}): update the code (git pull) to read it")
    written = version
    try:
        while version < FORMAT:
            ckpt = UPGRADES[version](ckpt)
            version += 1
        ckpt = {**ckpt, "config": {**ABSENT, **ckpt["config"]}}
    except (KeyError, TypeError, UserError) as e:
        raise UserError(f"{path} is a checkpoint of format {written} ({FORMATS[written]}) that cannot be upgraded "
                        f"to format {FORMAT}: {type(e).__name__} {e}; read it with that version, or train "
                        f"again") from None
    return ckpt


# ---- the file ------------------------------------------------------------------------------------------------

def save_checkpoint(state, path):
    """torch.save(state) atomically, so a crash or a full disk leaves the previous checkpoint intact."""
    try:
        with atomic_write(path, "wb") as f:
            torch.save(state, f)
    except (DiskFull, RuntimeError) as e:  # torch's zip writer reports a failed write as its own RuntimeError
        if not isinstance(e, DiskFull) and not any(s in str(e) for s in ("PytorchStreamWriter", "inline_container")):
            raise
        failed = e if isinstance(e, DiskFull) else (f"cannot write {path}: torch's writer stopped part-way (is the "
                                                    f"disk full? {run_folder.gb(run_folder.free_bytes(path))} free)")
        kept = f"{path} still holds the previous checkpoint" if os.path.exists(path) else "nothing was written"
        raise DiskFull(f"{failed}; {kept}") from None


def not_an_archive(path):
    """Whether the file at `path` has content and is no torch.save archive (a zip file, which begins so): another
    file given where a checkpoint or candidates file was meant. An empty file is a truncated archive."""
    with open(path, "rb") as f:
        return os.path.getsize(path) > 0 and f.read(4) != b"PK\x03\x04"


def load_checkpoint(path, key="ckpt"):
    """The Checkpoint in the file at `path`, upgraded to format FORMAT; refuses anything that is not plain tensors
    and containers. A missing file, one that is no checkpoint, or a truncated or damaged one is one line that says
    so (naming the flag `key` that took the path) and which other checkpoints beside it are intact."""
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "does not exist"
        raise UserError(f"checkpoint {path} {what}: train first, or pass --{key}=<a best.pt or ckpt.pt>"
                        + run_folder.missing_file_hint(path, f"--{key}"))
    if not_an_archive(path):
        raise UserError(f"{path} is not a checkpoint (train.py writes best.pt and ckpt.pt as torch.save "
                        f"archives): pass --{key}=<a best.pt or ckpt.pt>")
    if not complete_archive(path):
        raise UserError(f"checkpoint {path} is corrupted ({os.path.getsize(path):,} bytes, not a complete "
                        f"torch.save archive: truncated by a full disk or an interrupted copy?); "
                        + intact_neighbours(path))
    try:
        # mmap: ranks loading the same file share its pages, and tensors are read when used
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load checkpoint {path} safely (weights_only): {first_line}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint written by train.py")
    return upgraded(ckpt, path)


def complete_archive(path):
    """Whether `path` is a whole zip archive, torch.save's format: its directory is at the end, so a truncated
    file has none."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


def intact_neighbours(path):
    """Which of the other checkpoints in `path`'s folder load, as the clause that ends a corrupted-file error."""
    folder = os.path.dirname(os.path.abspath(path))
    intact = intact_in(folder, besides=path)
    if not intact:
        return f"no other checkpoint in {folder} is intact"
    use = ("start from its weights with --init_from=<that file>" if os.path.basename(path) == "ckpt.pt"
           else "score one with --ckpt=<that file>")
    return f"intact: {', '.join(intact)}; {use}"


def intact_in(folder, besides=None):
    """['folder/ckpt.pt (iter 5)', ...]: the checkpoints in `folder` (but `besides`) that load."""
    intact = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.pt"))):
        if besides and os.path.samefile(path, besides):
            continue
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            intact.append(f"{path} (iter {ckpt['iter_num']})")
        except Exception:
            continue
    return intact


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


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "[gloo]", "NCCL")


@contextlib.contextmanager
def lost_rank_keeps_checkpoints(folder, go_on):
    """A collective that fails because another rank is gone (killed, crashed, out of memory) ends in one line: what
    failed, the checkpoints of the run's `folder` that are intact, and `go_on`, the command that continues it."""
    try:
        yield
    except Exception as e:
        lost = isinstance(e, torch.distributed.DistError) or (
            isinstance(e, RuntimeError) and any(s in str(e) for s in PEER_LOST))
        if not lost or isinstance(e, UserError):
            raise
        intact = intact_in(folder)
        kept = f"intact: {', '.join(intact)}" if intact else "no checkpoint was written yet"
        first_line = str(e).strip().partition("\n")[0]
        raise UserError(f"another rank of this run is gone ({type(e).__name__}: {first_line}); {kept}; continue "
                        f"with: {go_on}") from None



# ---- the training state ------------------------------------------------------------------------------------

def configure_optimizer(model, cfg, device_type):
    """AdamW with weight decay on 2-D weights only (not biases, LayerNorms); fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                             fused=device_type == "cuda")


def rng_state():
    """This process's torch RNG (dropout); data order needs none, the sampler is a function of the step."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainingState:
    """What ckpt.pt holds and a resumed run restores: the model as the backend shards it, AdamW, the fp16
    GradScaler, the LR schedule, the optimizer steps done (`step`, saved as iter_num), the best score so far, the
    steps fp16 skipped, and each rank's RNG. The sampler needs no state of its own: a step's batch is a function
    of the step. What every checkpoint says of the run: where its weights started (`base`: its first session's
    init_from, kept through resumes as the config's), the training rows (inference refuses to score them), the
    validation split's digest, a LoRA base's reference, and `extra`, a stage's own keys."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: dict
    base: str
    train_rows: dict
    validation_digest: str
    lora_base: dict | None = None
    extra: dict = field(default_factory=dict)
    step: int = 0
    best_score: float | None = None
    best_val_loss: float | None = None  # the best evaluation's: it breaks a tie of best_metric
    skipped_steps: int = 0

    @classmethod
    def start(cls, model, cfg, rt, **record):
        """The state of a run at step 0: a fresh optimizer, scaler and schedule for `model` (sharded)."""
        return cls(model, configure_optimizer(model, cfg, rt.device.type),
                   torch.amp.GradScaler(rt.device.type, enabled=rt.use_scaler), lr_schedule(asdict(cfg)), **record)

    def improved(self, stats, metric):
        """Whether `metric` of an evaluation's stats beats the best so far (then it becomes the best): a higher
        ROUGE, or the same ROUGE (0 at the first evaluations of a run) with a lower validation loss; a lower
        val_loss. A non-finite score never does; with best_metric=last, every save is the best."""
        if metric == "last":
            return True
        score, best, val_loss = stats[metric], self.best_score, stats["val_loss"]
        if not math.isfinite(score):
            return False
        if best is None or metric == "val_loss":
            better = best is None or score < best
        else:
            best_val_loss = math.inf if self.best_val_loss is None else self.best_val_loss
            better = score > best or (score == best and val_loss < best_val_loss)
        if better:
            self.best_score, self.best_val_loss = score, val_loss
        return better

    def save(self, cfg, rt, metrics, best):
        """Rank 0 writes ckpt.pt, and with `best` best.pt (weights, config, metrics); the others wait. A LoRA run's
        ckpt.pt keeps its adapters and where its base comes from; its best.pt the merged weights. A save that
        cannot fit on the disk stops every rank with one line before anything is written."""
        rng = rt.all_gather_objects(rng_state())
        model_state, optimizer_state = rt.parallel.training_state(self.model, self.optimizer)
        writes = []
        if rt.is_main:
            model_args = asdict(self.model.config)
            record = Record(format=FORMAT, model_args=model_args, config={**asdict(cfg), "init_from": self.base,
                                                                     **shape_settings(model_args)},
                            tokenizer=data.TOKENIZER_ID, iter_num=self.step, best_metric=cfg.best_metric,
                            best_score=self.best_score, best_val_loss=self.best_val_loss,
                            metrics={k: v for k, v in metrics.items() if isinstance(v, float)},
                            train_rows=self.train_rows, validation_digest=self.validation_digest, model={})
            trained = ({"model": lora.adapter_state_dict(model_state), "lora_base": self.lora_base}
                       if self.lora_base else {"model": model_state})
            writes.append((os.path.join(cfg.out_dir, run_folder.CKPT),
                           {**record, **trained, **self.extra, "optimizer": optimizer_state,
                            "scaler": self.scaler.state_dict(), "rng": rng, "schedule": self.schedule,
                            "skipped_steps": self.skipped_steps}))
            if best:
                merged = lora.merged_state_dict(model_state, **lora.settings(cfg)) if cfg.lora_rank else model_state
                writes.append((os.path.join(cfg.out_dir, run_folder.BEST), {**record, "model": merged}))
        rt.stop_if(run_folder.save_problem(writes, self.step, run_folder.Quota.of(cfg)) if rt.is_main else None)
        for path, state in writes:
            save_checkpoint(state, path)
        rt.barrier()

    def restore(self, ckpt, cfg, rt, path):
        """Continue the checkpoint's run: its optimizer, scaler, step, best score, RNG and LR schedule, with the
        hyperparameters this run's config changed applied. Returns the lines that say so."""
        saved = ckpt["config"]
        if ckpt["iter_num"] >= cfg.max_iters:
            raise UserError(f"{path} is at iter {ckpt['iter_num']} and max_iters={cfg.max_iters}: nothing to train; "
                            f"continue with --max_iters above {ckpt['iter_num']}")
        notes = []
        if ckpt["train_rows"] is None:
            notes.append(f"note: {path} (format 1) kept no fingerprints of its training rows: that train_csv="
                         f"{cfg.train_csv} holds the same rows is not checked")
        elif ckpt["train_rows"]["digest"] != self.train_rows["digest"]:
            raise UserError(f"train_csv={cfg.train_csv} holds other rows than {path} was trained on (from "
                            f"{saved['train_csv']}): resume with that CSV, or train on this one in a new run that "
                            f"starts from its weights: --init_from={path} --out_dir=<a new folder>")
        rt.parallel.load_optimizer_state(self.model, self.optimizer, ckpt["optimizer"], path)
        # the optimizer's state dict brings back the saved run's AdamW settings: this run's config decides
        decay, no_decay = self.optimizer.param_groups
        decay["weight_decay"], no_decay["weight_decay"] = cfg.weight_decay, 0.0
        for group in self.optimizer.param_groups:
            group["betas"] = (cfg.beta1, cfg.beta2)
        if ckpt["scaler"]:  # {} from a run without fp16
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step, self.skipped_steps = ckpt["iter_num"], ckpt["skipped_steps"]
        if rt.rank < len(ckpt["rng"]):  # a rank the saved run did not have keeps its fresh seed
            set_rng_state(ckpt["rng"][rt.rank])
        self.schedule = resumed_schedule(ckpt["schedule"], saved, cfg, self.step)
        notes.insert(0, f"resuming {path} at iter {self.step}; "
                     + describe_schedule(self.schedule, self.step, cfg.max_iters))
        if ckpt["best_metric"] == cfg.best_metric:
            # best_val_loss: None before format 3, whose ties then go to the next evaluation
            self.best_score, self.best_val_loss = ckpt["best_score"], ckpt["best_val_loss"]
        else:
            kept = run_folder.keep_best_of_metric(cfg.out_dir, ckpt["best_metric"]) if rt.is_main else None
            notes.append(f"best_metric is now {cfg.best_metric} (was {ckpt['best_metric']}): best.pt follows "
                         f"{cfg.best_metric} from the next evaluation on"
                         + (f"; the best by {ckpt['best_metric']} is kept as {kept}" if kept else ""))
        if ckpt["validation_digest"] not in (None, self.validation_digest):
            notes.append(f"note: the validation rows are not those of {path}: best.pt's {cfg.best_metric} so far was "
                         f"measured on the others, so a later best.pt is chosen by another yardstick")
        changed = [f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in (*keys(AdamW), "dropout", "grad_clip")
                   if saved[k] != getattr(cfg, k)]
        if changed:
            notes.append(f"changed since the checkpoint, applied from iter {self.step}: {', '.join(changed)}")
        return notes
