//! Report sections of `fabric` programs (to be written).

use serde_json::Value;

use crate::report::figure::{BuildError, Section};

/// Sections of the `fabric` document.
pub fn fabric(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}
