"""ROUGE as the competition scores it (rouge-score F1, Porter stemmer on), and minimum Bayes risk decoding's choice
by it: the candidate summary that agrees most with the others."""
import functools

from nltk.stem import porter
from rapidfuzz import process
from rapidfuzz.distance import LCSseq
from rouge_score import rouge_scorer, tokenize, tokenizers
from rouge_score.scoring import fmeasure

import data
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


def mbr_pick(candidates, metric="rougeL"):
    """generate's mbr_pick, on token lists."""
    return mbr_select([data.summary_text(tokens) for tokens in candidates], metric)


def agreement(candidates, metric="rougeL"):
    """`metric` F1 of every candidate (row) against every other (column). rougeL's LCS comes from rapidfuzz
    (C++): rouge-score's was most of MBR's time."""
    tokenizer = StemCachedTokenizer()
    if metric == "rougeL":
        tokens = [tokenizer.tokenize(c) for c in candidates]
        lcs = process.cdist(tokens, tokens, scorer=LCSseq.similarity).tolist()
        return [[fmeasure(n / len(prediction), n / len(reference)) if prediction and reference else 0.0
                 for reference, n in zip(tokens, row, strict=True)]
                for prediction, row in zip(tokens, lcs, strict=True)]
    scorer = rouge_scorer.RougeScorer([metric], tokenizer=tokenizer)
    return [[scorer.score(reference, prediction)[metric].fmeasure for reference in candidates]
            for prediction in candidates]


def mbr_select(candidates, metric="rougeL"):
    """Index of the highest mean F1 against the others; ties go to the earlier."""
    scores = agreement(candidates, metric)
    utility = [(sum(row) - row[i]) / max(1, len(candidates) - 1) for i, row in enumerate(scores)]
    return max(range(len(candidates)), key=lambda i: (utility[i], -i))
