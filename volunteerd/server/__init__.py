"""The serving side of a daemon: what happens to a request from the moment the RPC layer
has decoded it until its reply is written, and what the control API reads of it."""
