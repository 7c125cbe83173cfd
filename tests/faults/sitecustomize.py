"""Fault injection for engine-core processes (which are spawned, so a patch made in the test's
own process never reaches them): Python runs this at start-up in every process started with
this folder on PYTHONPATH. While the file named by $TANDEM_TEST_FAULT_FILE exists, every engine
step raises, as a device fault would."""

import os

_TRIGGER = os.environ.get("TANDEM_TEST_FAULT_FILE")

if _TRIGGER:
    import tandem.engine.engine as _engine

    _real_step = _engine.Engine.step

    def _step(self):
        if os.path.exists(_TRIGGER):
            raise RuntimeError("injected fault: device on fire")
        return _real_step(self)

    _engine.Engine.step = _step
