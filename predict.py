"""Write submission.csv (id,summary) for test.csv with a trained checkpoint, prompted and decoded as its run was.

    python predict.py [preset] [--ckpt=path | --baseline=...] [--key=value ...]
    torchrun --nproc_per_node=2 predict.py [...]          the test set is sharded; rank 0 writes the file

An explicit --key=value changes a decoding setting (e.g. --num_beams=4), a preset does not."""
import summarizer  # the standard library alone: first, before seconds of imports

summarizer.until_imported(__name__)
from summarizer.inference import decoding_command
from summarizer.report import predict

summarizer.imported(__name__)


def main(argv=None):
    decoding_command(argv, __doc__, "predict.py", predict)


if __name__ == "__main__":
    main()
