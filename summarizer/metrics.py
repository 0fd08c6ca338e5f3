"""ROUGE as the competition scores it: rouge-score F1, Porter stemmer on."""
import functools

from nltk.stem import porter
from rouge_score import rouge_scorer, tokenize, tokenizers

from config import ROUGE_TYPES


def rouge_per_example(predictions, references):
    """{type: [f1 of each (prediction, reference)]}."""
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=StemCachedTokenizer())
    results = [scorer.score(reference, prediction)
               for prediction, reference in zip(predictions, references, strict=True)]
    return {t: [result[t].fmeasure for result in results] for t in ROUGE_TYPES}


def rouge(predictions, references):
    return {t: sum(v) / max(1, len(v)) for t, v in rouge_per_example(predictions, references).items()}


class StemCachedTokenizer(tokenizers.Tokenizer):
    """rouge-score's tokenizer and stemmer, each text and word done once: MBR scores every candidate
    against every other, and stemming is most of what tokenizing costs."""

    def __init__(self):
        self.stem = functools.cache(porter.PorterStemmer().stem)
        self.tokens = functools.cache(lambda text: tokenize.tokenize(text, self))

    def tokenize(self, text):
        return self.tokens(text)
