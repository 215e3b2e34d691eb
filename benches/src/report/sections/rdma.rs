//! Report sections of `rdma` programs (to be written).

use serde_json::Value;

use crate::report::figure::{BuildError, Section};

/// Sections of the `latency` document.
pub fn latency(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}
