"""Evaluation: the policies compared (`policies`), the greedy oracle (`oracle`), the run over batches (`run`) and
the report: rows, paired intervals, JSON, plots (`report`)."""
