"""The engine loop and what surrounds it: request intake, outputs, n > 1, stats (`Engine` is
in `tandem.engine.engine`: a front end imports the intake and detokenizer without it)."""
