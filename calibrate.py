"""The calibration stage (experimental, docs/calibration.md): continue a trained run with a ranking loss on
candidate summaries that the run's own weights write for every training dialogue. It is train.py's loop with the
Ranking objective of summarizer/ranking.py; every train.py setting and launcher applies.

    python calibrate.py [preset] --init_from=out/best.pt --out_dir=out-calibrated --rank_weight=1.0 [--key=value ...]
    torchrun --nproc_per_node=N --standalone calibrate.py [...]
"""
import train
from summarizer.ranking import Ranking


def main(argv=None):
    """As train.main (argv None: the command line's, and max_time counts from the process's start)."""
    train.main(argv, objective=Ranking, script="calibrate.py")


if __name__ == "__main__":
    main()
