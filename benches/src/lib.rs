//! Shared pieces of the pindown benchmark programs.
//!
//! * [`traces`]: reproducible (seeded) access traces over numbered buffers.
//! * [`replay`]: replays a trace against a [`pincache::PinCache`] and counts
//!   hits, misses and evictions, optionally doing a transfer per access.
//! * [`sys`]: anonymous memory, `RLIMIT_MEMLOCK` and machine facts.
//! * [`stats`]: medians and least-squares fits.
//!
//! The binaries `pin-hitrate` and `pin-cost`, the criterion benchmark and the
//! integration tests all use these modules, so that what the tests check is
//! what the programs measure.

#![warn(missing_docs)]

pub mod replay;
pub mod stats;
pub mod sys;
pub mod traces;
