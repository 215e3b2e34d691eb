//! The vhost-user request loop pieces: message decoding, socket I/O and
//! request semantics.
pub mod conn;
pub mod handler;
pub mod message;
