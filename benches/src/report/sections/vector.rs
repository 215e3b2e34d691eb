//! Report sections of `vector` programs (to be written).

use serde_json::Value;

use crate::report::figure::{BuildError, Section};

/// Sections of the `vector_transfer` document.
pub fn vector_transfer(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}
