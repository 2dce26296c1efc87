"""What the three service stages share and clients never need: the stage runtime (`stage`: flags,
sockets, signals, sd_notify, the reject log) and the server half of CURVE (`security`). The stage
packages (`tokenizer_proc`, `engine_proc`, `detok_proc`) import it; the client package does not."""
