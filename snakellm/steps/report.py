"""``snakellm report <what>``: figures and tables for ``snakemake --report``.

One subcommand per report output family (rules/report.smk calls each once per
source, tokenizer or run). Everything is read from files earlier steps wrote;
outputs are written atomically and are byte-stable for the same inputs.
"""

from __future__ import annotations

import argparse
import sys

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.io.atomic import write_text
from snakellm.report.data import ReportInputError


def _data(a: argparse.Namespace) -> None:
    from snakellm.report import data

    chunks = data.load_chunks(a.stats)
    write_text(a.table, data.source_table(a.source, chunks, data.rejection_examples(chunks)))
    data.source_plot(a.source, chunks, a.plot)


def _data_overview(a: argparse.Namespace) -> None:
    from snakellm.report import data

    write_text(a.output, data.overview_table(data.load_chunks(a.stats)))


def _download(a: argparse.Namespace) -> None:
    from snakellm.report import data

    write_text(a.output, data.download_table(a.source, a.manifests, a.logs or []))


def _tokens(a: argparse.Namespace) -> None:
    from snakellm.report import tokens

    blend = tokens.load_blend(a.blend)
    lengths = tokens.document_lengths(a.idx)
    write_text(a.table, tokens.tokenizer_tables(blend, a.stats, lengths))
    tokens.blend_plot(blend, a.blend_plot)
    tokens.lengths_plot(blend["tokenizer"].get("name", ""), lengths, a.lengths_plot)


def _tokens_overview(a: argparse.Namespace) -> None:
    from snakellm.report import tokens

    tokens.overview(a.blends, a.table, a.plot)


def _tokenizer(a: argparse.Namespace) -> None:
    from snakellm.report import tokens
    from snakellm.tokenize import encoders

    tok = encoders.from_args(a)
    texts = tokens.example_texts(a.sample, a.key, n=a.examples)
    write_text(a.output, tokens.tokenizer_page(tok, texts, a.train_stats))


def _train(a: argparse.Namespace) -> None:
    from snakellm.report import data, train

    recs = train.load_metrics(a.metrics)
    summary = data.read_json(a.summary)
    train.plot_loss(a.run, recs, a.prefix + ".loss.svg")
    train._series(a.run, recs, "lr", "learning rate", "learning rate", a.prefix + ".lr.svg")
    train._series(
        a.run,
        recs,
        "grad_norm",
        "gradient norm (before clipping)",
        "gradient norm",
        a.prefix + ".grad_norm.svg",
        log=True,
    )
    train.plot_throughput(a.run, recs, a.prefix + ".throughput.svg")
    write_text(a.prefix + ".summary.html", train.summary_page(a.run, recs, summary, a.summary))


def _table(a: argparse.Namespace) -> None:
    from snakellm.report import table

    write_text(a.output, table.table_page(a.files, a.title, a.note or "", a.max_rows))


def _lm_eval(a: argparse.Namespace) -> None:
    from snakellm.report import evaluation

    write_text(a.table, evaluation.lm_eval_page(a.run, a.results))
    evaluation.lm_eval_plot(a.run, a.results, a.plot)


def _finetune(a: argparse.Namespace) -> None:
    from snakellm.report import evaluation as ev
    from snakellm.report.train import load_metrics

    recs = load_metrics(a.metrics)
    page = ev.finetune_page(
        a.name,
        ev.read_json(a.summary),
        ev.read_json(a.base) if a.base else {},
        ev.read_json(a.tuned) if a.tuned else {},
        ev.read_jsonl(a.base_predictions) if a.base_predictions else [],
        ev.read_jsonl(a.tuned_predictions) if a.tuned_predictions else [],
        ev.read_json(a.comparison) if a.comparison else None,
        recs,
    )
    write_text(a.page, page)
    ev.plot_finetune_loss(a.name, recs, a.loss)


def _add_stage_parsers(sub: argparse._SubParsersAction) -> None:
    """The later stages' pages: a run's lm-eval suites, a fine-tune."""
    s = sub.add_parser("lm-eval", help="a run's lm-eval suites: tables with example documents, a bar chart of scores")
    s.add_argument("results", nargs="+", help="runs/{run}/lm_eval/{suite}.json (lm-eval's results and samples)")
    s.add_argument("--run", required=True)
    s.add_argument("--table", required=True, help="output .html")
    s.add_argument("--plot", required=True, help="output .svg")
    s.set_defaults(func=_lm_eval)

    s = sub.add_parser("finetune", help="a fine-tune: loss curve, base vs tuned, example predictions, settings")
    s.add_argument("--name", required=True, help="the fine-tune's name")
    s.add_argument("--metrics", required=True, help="runs/{run}/finetune/{ft}/metrics.jsonl")
    s.add_argument("--summary", required=True, help="runs/{run}/finetune/{ft}/finetune_summary.json")
    s.add_argument("--base", help="the base model's metrics.json on the test split (not for a DPO fine-tune)")
    s.add_argument("--tuned", help="the tuned model's metrics.json (not for a DPO fine-tune)")
    s.add_argument("--base-predictions", help="the base model's predictions (.jsonl)")
    s.add_argument("--tuned-predictions", help="the tuned model's predictions (.jsonl)")
    s.add_argument("--comparison", help="the base-vs-tuned comparison.json (snakellm compare-eval), if any")
    s.add_argument("--page", required=True, help="output .html")
    s.add_argument("--loss", required=True, help="output .svg")
    s.set_defaults(func=_finetune)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm report",
        description="Write the plots (SVG, matplotlib) and tables (self-contained HTML) that rules/report.smk "
        "puts into `snakemake --report`. Each subcommand reads only files earlier steps wrote.",
    )
    sub = p.add_subparsers(dest="what", required=True, metavar="<what>")

    s = sub.add_parser("data", help="one source: documents, bytes, rejected lines by reason (table + bar chart)")
    s.add_argument(
        "stats",
        nargs="+",
        help="the source's data/jsonl/{source}/{chunk}.stats.json (the .rejected.jsonl next to each is read too)",
    )
    s.add_argument("--source", required=True)
    s.add_argument("--table", required=True, help="output .html")
    s.add_argument("--plot", required=True, help="output .svg")
    s.set_defaults(func=_data)

    s = sub.add_parser("data-overview", help="every source in one table")
    s.add_argument("stats", nargs="+", help="every chunk's .stats.json")
    s.add_argument("--output", required=True, help="output .html")
    s.set_defaults(func=_data_overview)

    s = sub.add_parser("download", help="an http source's downloads: shards, bytes, requests, retries")
    s.add_argument("manifests", nargs="+", help="data/raw/{source}/{chunk}.manifest.json, in chunk order")
    s.add_argument(
        "--logs",
        nargs="+",
        help="the download jobs' logs, one per manifest in the same order (retries are counted there)",
    )
    s.add_argument("--source", required=True)
    s.add_argument("--output", required=True, help="output .html")
    s.set_defaults(func=_download)

    s = sub.add_parser("tokens", help="one tokenizer: tokens per source and chunk, blend shares, tokens per document")
    s.add_argument("--blend", required=True, help="data/tokens/{tokenizer}/blend.json")
    s.add_argument("--stats", nargs="+", required=True, help="the chunks' {prefix}.stats.json")
    s.add_argument("--idx", nargs="+", required=True, help="the chunks' {prefix}.idx (document lengths)")
    s.add_argument("--table", required=True, help="output .html")
    s.add_argument("--blend-plot", required=True, help="output .svg: share of tokens vs share in the blend")
    s.add_argument("--lengths-plot", required=True, help="output .svg: histogram of tokens per document")
    s.set_defaults(func=_tokens)

    s = sub.add_parser("tokens-overview", help="tokens per source under every tokenizer")
    s.add_argument("blends", nargs="+", help="data/tokens/{tokenizer}/blend.json")
    s.add_argument("--table", required=True, help="output .html")
    s.add_argument("--plot", required=True, help="output .svg")
    s.set_defaults(func=_tokens_overview)

    s = sub.add_parser("tokenizer", help="a tokenizer: vocab, training sample, example encodings of real text")
    from snakellm.tokenize.encoders import add_arguments

    add_arguments(s)
    s.add_argument("--sample", required=True, help="a chunk's .jsonl to take example texts from")
    s.add_argument("--key", default="text", help="the JSON key of the text (default text)")
    s.add_argument("--examples", type=int, default=4, help="how many texts to encode (default 4)")
    s.add_argument("--train-stats", help="tokenizers/{name}/tokenizer.stats.json of a trained tokenizer")
    s.add_argument("--output", required=True, help="output .html")
    s.set_defaults(func=_tokenizer)

    s = sub.add_parser("train", help="a pretraining run: loss, lr, grad norm, throughput plots and a summary table")
    s.add_argument("--run", required=True)
    s.add_argument("--metrics", required=True, help="runs/{run}/metrics.jsonl")
    s.add_argument("--summary", required=True, help="runs/{run}/train_summary.json")
    s.add_argument(
        "--prefix", required=True, help="writes PREFIX.{loss,lr,grad_norm,throughput}.svg and PREFIX.summary.html"
    )
    s.set_defaults(func=_train)

    _add_stage_parsers(sub)

    s = sub.add_parser(
        "table", help="any JSON / JSONL / CSV / TSV file(s) as an HTML table (for later stages' metrics and samples)"
    )
    s.add_argument("files", nargs="+")
    s.add_argument("--output", required=True, help="output .html")
    s.add_argument("--title", required=True)
    s.add_argument("--note", help="a line under the title")
    s.add_argument("--max-rows", type=int, default=50, help="records shown per file (default 50)")
    s.set_defaults(func=_table)
    for each in sub.choices.values():  # add_parser does not pass the formatter on
        each.formatter_class = DefaultsHelpFormatter
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        a.func(a)
    except (ReportInputError, OSError) as e:
        print(f"snakellm report {a.what}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # tokenizer load errors etc.: name them, no traceback for bad input
        from snakellm.tokenize.encoders import TokenizerError

        if isinstance(e, TokenizerError):
            print(f"snakellm report {a.what}: error: {e}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
