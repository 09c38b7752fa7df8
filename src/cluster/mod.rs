//! Many hosts behind one endpoint (docs/cluster.md).
//!
//! Each node is a whole agentenv server; a standard load balancer spreads clients over
//! them and any node answers any request. Sandbox ids name their node ([`id`]), so a
//! request for a sandbox goes to its owner with no shared table; there is no cluster
//! manager, consensus or database of our own.

pub mod id;
pub mod peer;
