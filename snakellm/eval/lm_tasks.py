"""The default lm-eval suite, built from the shipped data: jsonl files and lm-eval task YAMLs (torch-free).

Four tasks in lm-evaluation-harness's own formats, each over local jsonl only (``dataset_path: json``),
so the evaluation needs no network and no Hugging Face Hub data sets:

* ``snakellm_wikitext``: WikiText-2-style document perplexity (``loglikelihood_rolling``; lm-eval's
  ``wikitext`` metrics: word_perplexity, byte_perplexity, bits_per_byte) on Wikipedia articles.
* ``snakellm_lambada``: a LAMBADA-style last-word cloze (``loglikelihood``; perplexity and acc, as
  lm-eval's ``lambada_openai``) on passages from the same articles.
* ``snakellm_cont4``: a 4-way multiple-choice sentence continuation (HellaSwag's shape: the true
  ending against three endings of other sentences; acc and acc_norm).
* ``snakellm_squad``: extractive QA on the shipped SQuAD subset as ``generate_until`` (exact match
  against any gold answer, case and punctuation ignored).

Held out: the Wikipedia text is the articles of ``resources/wikipedia/enwiki-pages-articles-excerpt.xml.bz2``
(cleaned by :mod:`snakellm.data.mediawiki`), which the default config does not train on (its sources are the
WikiText-2 test articles and Botchan); the SQuAD subset is not pretraining data either (the fine-tuning
example trains on part of it). Everything is deterministic: the same resources give the same bytes.

The YAMLs name their jsonl files by paths relative to the working directory (the workflow's root), as
Snakemake runs every job there; ``snakellm evaluate-lm`` passes the directory as lm-eval's include_path.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

from snakellm.io.atomic import write_text

WIKIPEDIA = "resources/wikipedia/enwiki-pages-articles-excerpt.xml.bz2"
SQUAD = "resources/squad/squad-dev-subset.json"
TASKS = ("snakellm_wikitext", "snakellm_lambada", "snakellm_cont4", "snakellm_squad")
SEED = 1234
# sizes of the test splits (the suite's `limit` takes fewer); a few-shot split ("train") of FEWSHOT docs each
SIZES = {"snakellm_wikitext": 60, "snakellm_lambada": 300, "snakellm_cont4": 300, "snakellm_squad": 200}
FEWSHOT = 10
DOC_CHARS = 2000  # a WikiText-style document: an article's leading paragraphs, about this long

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_WORD = re.compile(r"[A-Za-z]{3,}")

YAML = {
    "snakellm_wikitext": """task: snakellm_wikitext
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/snakellm_wikitext.test.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:  # lm-eval's own defaults, spelled out (it warns about each one left out)
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
  source: "{wikipedia} (held out), the leading paragraphs of each article"
""",
    "snakellm_lambada": """task: snakellm_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    train: {dir}/snakellm_lambada.train.jsonl
    test: {dir}/snakellm_lambada.test.jsonl
test_split: test
fewshot_split: train
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  source: "{wikipedia} (held out), passages ending in a word"
""",
    "snakellm_cont4": """task: snakellm_cont4
dataset_path: json
dataset_kwargs:
  data_files:
    train: {dir}/snakellm_cont4.train.jsonl
    test: {dir}/snakellm_cont4.test.jsonl
test_split: test
fewshot_split: train
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  source: "{wikipedia} (held out), sentences split in two; distractors: endings of other sentences"
""",
    "snakellm_squad": """task: snakellm_squad
dataset_path: json
dataset_kwargs:
  data_files:
    train: {dir}/snakellm_squad.train.jsonl
    test: {dir}/snakellm_squad.test.jsonl
test_split: test
fewshot_split: train
output_type: generate_until
doc_to_text: "Context: {{{{context}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: answers
target_delimiter: " "
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
  source: "{squad}, answerable questions in file order, all gold answers"
""",
}


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of running text (no headings, lists or references): 40+ words ending a sentence."""
    out = []
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        if len(para.split()) >= 40 and para[-1] in ".!?" and "|" not in para and "=" not in para:
            out.append(para)
    return out


def wikipedia_articles(path: str = WIKIPEDIA) -> list[tuple[str, str]]:
    """(title, cleaned text) of every article of the dump excerpt, in dump order."""
    from snakellm.data.mediawiki import iter_pages

    return [(p.title, p.text) for p in iter_pages(path) if not p.skip and p.text.strip()]


def wikitext_docs(articles: list[tuple[str, str]], n: int) -> list[dict]:
    """WikiText-style documents: each article's leading prose paragraphs, about DOC_CHARS characters (half at least)."""
    docs = []
    for title, text in articles:
        paras = _prose_paragraphs(text)
        page = ""
        for para in paras:
            page = f"{page}\n\n{para}" if page else para
            if len(page) >= DOC_CHARS:
                break
        if len(page) >= DOC_CHARS // 2:  # a stub's one paragraph is no document
            docs.append({"title": title, "page": page})
        if len(docs) == n:
            break
    return docs


def _sentences(articles: list[tuple[str, str]]) -> Iterator[tuple[str, list[str]]]:
    """(title, the sentences of one prose paragraph), skipping each article's lead (the wikitext task's text)."""
    for title, text in articles:
        for para in _prose_paragraphs(text)[3:]:
            yield title, _SENTENCE_END.split(para)


def cloze_docs(articles: list[tuple[str, str]], n: int) -> list[dict]:
    """LAMBADA-style passages: up to 3 sentences ending in a word of 3+ letters (the target), 25-90 words."""
    docs: list[dict] = []
    for title, sents in _sentences(articles):
        for end in range(len(sents) - 1, -1, -1):
            passage = " ".join(sents[max(0, end - 2) : end + 1]).rstrip(".!?")
            last = passage.split(" ")[-1]
            if _WORD.fullmatch(last) and 25 <= len(passage.split()) <= 90:
                docs.append({"title": title, "text": passage})
                break
        if len(docs) == n:
            break
    return docs


def continuation_docs(articles: list[tuple[str, str]], n: int, seed: int = SEED) -> list[dict]:
    """4-way continuation: a sentence's first half, its true second half and three other sentences' endings."""
    pool = [
        (title, s.split())
        for title, sents in _sentences(articles)
        for s in sents[:2]  # two sentences per paragraph: more articles in a few hundred docs
        if 12 <= len(s.split()) <= 40
    ]
    rng = random.Random(seed)
    docs = []
    for i, (title, words) in enumerate(pool[:n]):
        cut = len(words) // 2
        others = rng.sample([j for j in range(len(pool)) if j != i], 3)
        endings = [" ".join(words[cut:])] + [" ".join(pool[j][1][len(pool[j][1]) // 2 :]) for j in others]
        label = rng.randrange(4)
        endings[0], endings[label] = endings[label], endings[0]
        docs.append({"title": title, "context": " ".join(words[:cut]), "endings": endings, "label": label})
    return docs


def squad_docs(path: str = SQUAD) -> list[dict]:
    """Answerable SQuAD questions in file order, with every distinct gold answer."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    docs = []
    for article in data["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                answers = list(dict.fromkeys(a["text"] for a in qa.get("answers", []) if a["text"].strip()))
                if answers and not qa.get("is_impossible"):
                    docs.append(
                        {"id": qa["id"], "context": para["context"], "question": qa["question"], "answers": answers}
                    )
    return docs


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def build_default_suite(out_dir: str | Path, *, wikipedia: str = WIKIPEDIA, squad: str = SQUAD) -> dict[str, int]:
    """Write the four tasks' jsonl splits and YAMLs into ``out_dir``; the test-split sizes by task.

    Each task's few-shot split ("train") is FEWSHOT docs that follow its test docs, never the same ones.
    """
    out = Path(out_dir)
    articles = wikipedia_articles(wikipedia)
    k = FEWSHOT
    built: dict[str, tuple[list[dict], list[dict]]] = {
        "snakellm_wikitext": (wikitext_docs(articles, SIZES["snakellm_wikitext"]), []),
    }
    for task, docs in (
        ("snakellm_lambada", cloze_docs(articles, SIZES["snakellm_lambada"] + k)),
        ("snakellm_cont4", continuation_docs(articles, SIZES["snakellm_cont4"] + k)),
        ("snakellm_squad", squad_docs(squad)[: SIZES["snakellm_squad"] + k]),
    ):
        built[task] = (docs[:-k], docs[-k:])
    counts = {}
    for task, (test, train) in built.items():
        if len(test) < 10:
            raise ValueError(f"{task}: only {len(test)} documents could be built from {wikipedia} / {squad}")
        write_text(out / f"{task}.test.jsonl", _jsonl(test))
        if train:
            write_text(out / f"{task}.train.jsonl", _jsonl(train))
        write_text(out / f"{task}.yaml", YAML[task].format(dir=out.as_posix(), wikipedia=wikipedia, squad=squad))
        counts[task] = len(test)
    return counts
