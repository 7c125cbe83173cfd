"""The engine-core process and a front end's link to it: `wire` (the messages), `process` (the
core: the engine's loop behind one ZeroMQ socket), `client` (a front end's connection to the
cores). Nothing here knows HTTP or any API."""
