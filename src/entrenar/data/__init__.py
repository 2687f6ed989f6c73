"""Data: read records, tokenize with masks, and batch them (packed or padded) for training."""

from entrenar.data.batching import (
    BatchStream,
    check_seq_len,
    collate,
    eval_batches,
    num_target_tokens,
    packed_documents,
    padding_free,
    segment_capacity,
    split_validation,
)
from entrenar.data.sources import ReadStats, Record, read_records
from entrenar.data.templates import assistant_spans, render_chat
from entrenar.data.tokenize import IGNORE_INDEX, Example, TokenizeStats, tokenize_record, tokenize_records

__all__ = [
    "IGNORE_INDEX",
    "BatchStream",
    "Example",
    "ReadStats",
    "Record",
    "TokenizeStats",
    "assistant_spans",
    "check_seq_len",
    "collate",
    "eval_batches",
    "num_target_tokens",
    "packed_documents",
    "padding_free",
    "segment_capacity",
    "read_records",
    "render_chat",
    "split_validation",
    "tokenize_record",
    "tokenize_records",
]
