//! Checks on what ranks say of themselves through the launcher: any rank
//! may publish anything under its name, and may read the others' records
//! before it publishes its own.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pindown_driver::launch::Job;
use pindown_uapi::NodeId;

use crate::error::{Error, Result};

/// Fails unless every rank names a port no other rank names: `ports`
/// gives each rank's (node, port), in rank order. A rank claiming another
/// rank's port would have windows meant for that rank bound for it, or
/// its peers' writes meant for it sent to the other.
pub(crate) fn distinct_ports(ports: impl IntoIterator<Item = (NodeId, u16)>) -> Result<()> {
    let mut owners = HashMap::new();
    for (rank, port) in ports.into_iter().enumerate() {
        if let Some(first) = owners.insert(port, rank) {
            return Err(Error::BadPeerRecord {
                rank: rank as u32,
                why: format!(
                    "it names port {}:{}, which rank {first} names too",
                    port.0, port.1
                ),
            });
        }
    }
    Ok(())
}

/// The configuration values every rank of a job must share, as text
/// naming each (`"Config::slots 64, Config::communicators 16"`): gathered
/// from every rank through the launcher and compared whole, so that two
/// configurations of the same size in memory cannot pass for each other.
pub(crate) fn same_shape(job: &mut Job, key: &str, mine: &str) -> Result<()> {
    let shapes = job.all_gather(key, mine.as_bytes())?;
    match shapes.iter().position(|shape| shape != mine.as_bytes()) {
        Some(rank) => Err(Error::Mismatch(format!(
            "rank {rank} uses {}, this rank {mine}: every rank must use the same",
            String::from_utf8_lossy(&shapes[rank])
        ))),
        None => Ok(()),
    }
}

/// The deadline `timeout` from now; `None` (no deadline) when it lies
/// beyond the clock's range.
pub(crate) fn deadline_after(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_named_twice_is_refused_naming_the_second_rank() {
        assert!(distinct_ports([(0, 1), (0, 2), (1, 1)]).is_ok());
        match distinct_ports([(0, 1), (0, 2), (0, 1)]) {
            Err(Error::BadPeerRecord { rank: 2, why }) => assert!(why.contains("rank 0"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
