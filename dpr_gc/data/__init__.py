"""Inputs: training files and BEIR folders, passage corpora and query files, the Arrow cache, batch sampling.

Every file a user hands the toolkit as data is read and validated here once, so the stages above share one reader per
format. Uses :mod:`dpr_gc.model` only for tokenisation; never a stage.
"""
