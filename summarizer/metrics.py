"""ROUGE as the competition scores it (rouge-score F1, Porter stemmer on), and the minimum-Bayes-risk pick that
uses the same scores to choose, among sampled summaries, the one that agrees most with the others."""
import functools

from nltk.stem import porter
from rapidfuzz import process
from rapidfuzz.distance import LCSseq
from rouge_score import rouge_scorer, scoring, tokenize, tokenizers

from config import ROUGE_TYPES


def rouge_per_example(predictions, references):
    """rouge-score F1 (Porter stemmer on) for each (prediction, reference) pair: {type: [f1, ...]}."""
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=StemCachedTokenizer())
    scores = {t: [] for t in ROUGE_TYPES}
    for prediction, reference in zip(predictions, references):
        result = scorer.score(reference, prediction)
        for t in ROUGE_TYPES:
            scores[t].append(result[t].fmeasure)
    return scores


def rouge(predictions, references):
    """Mean ROUGE F1 over the pairs: {type: mean}."""
    return {t: sum(v) / max(1, len(v)) for t, v in rouge_per_example(predictions, references).items()}


class StemCachedTokenizer(tokenizers.Tokenizer):
    """rouge-score's own tokenizer with its Porter stemmer, each distinct text tokenized and each distinct word
    stemmed once: MBR scores every candidate against every other, stemming is most of what tokenizing costs, and
    summaries repeat their words. Same tokens as rouge-score's default."""

    def __init__(self):
        self.stem = functools.cache(porter.PorterStemmer().stem)
        self.tokens = functools.cache(lambda text: tokenize.tokenize(text, self))

    def tokenize(self, text):
        return self.tokens(text)


def agreement(candidates, metric="rougeL"):
    """The matrix of `metric` F1 of every candidate (row) scored against every other as the reference (column),
    as rouge-score computes it. For rougeL the longest common subsequences of all pairs come at once from
    rapidfuzz's LCS, in C++; rouge-score's is a Python table per pair, which was most of MBR's time."""
    tokenizer = StemCachedTokenizer()
    if metric == "rougeL":
        tokens = [tokenizer.tokenize(c) for c in candidates]
        lcs = process.cdist(tokens, tokens, scorer=LCSseq.similarity).tolist()
        return [[scoring.fmeasure(n / len(prediction), n / len(reference)) if prediction and reference else 0.0
                 for reference, n in zip(tokens, row)] for prediction, row in zip(tokens, lcs)]
    scorer = rouge_scorer.RougeScorer([metric], tokenizer=tokenizer)
    return [[scorer.score(reference, prediction)[metric].fmeasure for reference in candidates]
            for prediction in candidates]


def mbr_select(candidates, counts, metric="rougeL"):
    """Index of the candidate with the highest mean `metric` F1 against the other candidates, where candidate i
    stands for counts[i] identical samples (its copies count as others, scoring 1.0 when not empty). Ties go to
    the earlier candidate."""
    scores, total = agreement(candidates, metric), sum(counts)
    utility = [(sum(c * a for c, a in zip(counts, row)) - row[i]) / max(1, total - 1) for i, row in enumerate(scores)]
    return max(range(len(candidates)), key=lambda i: (utility[i], -i))
