"""Imported at start-up by the worker processes of the restart test (this folder is put on their PYTHONPATH):
rank 1 exits hard right after logging step $ENTRENAR_TEST_DIE_AT, on torchrun's first attempt only."""

import os

if os.environ.get("ENTRENAR_TEST_DIE_AT") and os.environ.get("RANK") == "1" \
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    from entrenar.train import metrics

    _real_log_step = metrics.MetricsLogger.log_step
    _die_at = int(os.environ["ENTRENAR_TEST_DIE_AT"])

    def _log_step(self, step, *args, **kwargs):
        record = _real_log_step(self, step, *args, **kwargs)
        if step == _die_at:
            os._exit(17)  # no cleanup, no error file: as a crash or the OOM killer would leave it
        return record

    metrics.MetricsLogger.log_step = _log_step
