//! Wire protocols shared by the guest side, the API proxy and the CLI.
//!
//! `connect` is the Connect RPC codec (JSON messages, streaming envelopes) that the
//! in-guest envd serves, the console's terminal speaks through the proxy, and
//! `agentenv exec` speaks from the command line.

pub mod connect;
