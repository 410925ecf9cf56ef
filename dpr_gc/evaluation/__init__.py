"""Scoring retrieval: DPR answer matching, qrels metrics as trec_eval computes them, and results files.

Kept apart from retrieval so that ``dpr-gc evaluate`` judges a run file from any system without loading a model.
"""
