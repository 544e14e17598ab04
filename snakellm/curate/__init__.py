"""Data curation: exact and MinHash near-duplicate removal, quality filters and language identification.

The stages are file targets (rules/curate.smk): per-chunk signatures and filter verdicts
(:mod:`snakellm.curate.signatures`), a duplicate index across the source built by
band-sharded bucket jobs and one clustering job (:mod:`snakellm.curate.index`), and
per-chunk curated outputs (:mod:`snakellm.curate.apply`). docs/data.md#curation.
"""
