//! Report sections of `messaging` programs (to be written).

use serde_json::Value;

use crate::report::figure::{BuildError, Section};

/// Sections of the `fmpl` document.
pub fn fmpl(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}

/// Sections of the `gasnet` document.
pub fn gasnet(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let _ = doc;
    Ok(Vec::new())
}
