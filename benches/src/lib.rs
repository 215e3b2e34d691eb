//! Shared pieces of the pindown benchmark programs.
//!
//! * [`traces`]: reproducible (seeded) access traces over numbered buffers.
//! * [`replay`]: replays a trace against a [`pindown_pincache::PinCache`] and counts
//!   hits, misses and evictions, optionally doing a transfer per access.
//! * [`sys`]: anonymous memory, the lockable-memory budget and machine
//!   facts.
//! * [`stats`]: medians and least-squares fits.
//! * [`output`]: the progress display and the JSON document.
//! * [`unmap`]: the timed `munmap` of a one-page mapping, plain or of a
//!   region a cache holds, invalidated through the hook or by the monitor.
//! * [`rdma`]: event-driven and busy-poll modes, requests one at a time or
//!   several in flight, verification patterns, and the emulated NIC run from
//!   a program's own executable.
//! * [`ping_pong`]: the latency baseline, a cache line bounced between
//!   two cores.
//! * [`raw_write`]: the RDMA write ping-pong between two ranks (body, then
//!   a fenced flag word), the baseline of the messaging libraries' figures.
//! * [`memory_kind`]: the memory a figure is measured on (the DMA arena or
//!   the heap).
//! * [`child`]: child processes (the device, ranks spoken to over pipes)
//!   stopped and reaped on drop.
//! * [`submatrix`]: DIMMnet-2's submatrix transfer: the matrix, the host's
//!   pack, unpack and one-pass copy, and cache eviction.
//! * [`mpi`]: the MPI baseline programs (the vector ping-pong, the peers of
//!   the FMPL figures and of the GASNet figures: ping-pong and get, halo
//!   faces, Himeno), built and launched by each MPI's own tools.
//! * [`fabric`]: two hosts (network namespaces and a veth pair, or
//!   loopback) for device processes joined over UDP, the raw UDP
//!   baselines between them, and the fabric's memory figures.
//! * [`ucx`]: the UCX peer of `pin-cost` (UCX's registration cache with an
//!   `mlock` pin), built with the C compiler and run at run time.
//!
//! * [`report`]: `pindown-report`, every program in one run, written as
//!   JSON, plots and a Markdown report.
//!
//! The binaries `pin-hitrate`, `pin-cost`, `pindown-demo`, `latency`,
//! `vector-transfer`, `fabric`, `fmpl` and `gasnet`, the criterion
//! benchmarks and the integration tests all use these modules, so that what
//! the tests check is what the programs measure.

#![warn(missing_docs)]

pub mod child;
pub mod fabric;
pub mod memory_kind;
pub mod mpi;
pub mod output;
pub mod ping_pong;
pub mod raw_write;
pub mod rdma;
pub mod replay;
pub mod report;
pub mod stats;
pub mod submatrix;
pub mod sys;
pub mod traces;
pub mod ucx;
pub mod unmap;
