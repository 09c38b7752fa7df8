//! agentenv: AI-agent sandboxes as microVMs, one network namespace each, behind an
//! E2B-style REST API.
//!
//! Data flows one way: `api` → `orchestrator` → `vm` / `net` / `hooks` / `store` /
//! `image` → `sys`. `agent` is the host↔guest protocol shared with the in-guest agent
//! (`guest`, built into the `agentenv-agent` binary); `protocol` holds the wire protocols
//! that the guest, the envd proxy and the CLI share (the Connect codec).

pub mod agent;
pub mod api;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod envd;
pub mod guest;
pub mod hooks;
pub mod image;
pub mod net;
pub mod orchestrator;
pub mod preflight;
pub mod protocol;
pub mod server;
pub mod store;
pub mod sys;
pub mod util;
pub mod vm;
pub mod volume;
