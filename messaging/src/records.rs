//! Checks on what ranks say of themselves through the launcher: any rank
//! may publish anything under its name, and may read the others' records
//! before it publishes its own.

use std::collections::HashMap;

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
