//! What a report section is made of: figures (series of points that
//! become a plot), rows (one figure of merit beside the paper's number, the
//! peers' numbers and the limit measured in the same run), and the helpers
//! that read them out of a program's JSON document.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Who a series or a number comes from; decides its colour and line style.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Measured on pindown in this run.
    Ours,
    /// Measured on a peer library (Open MPI, MPICH, UCX) in this run.
    Peer,
    /// A physical limit or baseline measured in this run (memcpy, a
    /// cache-line ping-pong, raw UDP, a raw RDMA write).
    Limit,
    /// A number printed in the paper (not measured here).
    Paper,
}

/// One line of a plot.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Who the points come from.
    pub role: Role,
    /// `(x, y)` pairs in the axes' units, in x order.
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// A series of `role` named `name`.
    pub fn new(name: impl Into<String>, role: Role, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            role,
            points,
        }
    }
}

/// An axis: its label (with the unit) and whether it is logarithmic.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Axis {
    /// Label, unit included ("message size (bytes)").
    pub label: String,
    /// Logarithmic scale (every value must then be positive).
    pub log: bool,
}

impl Axis {
    /// A linear axis.
    pub fn linear(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            log: false,
        }
    }

    /// A logarithmic axis.
    pub fn log(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            log: true,
        }
    }
}

/// One plot: written as `ID.svg` and `ID.png`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Figure {
    /// File stem, unique in the report (`pin-cost-table2`).
    pub id: String,
    /// Title over the plot.
    pub title: String,
    /// The paper figure or table it reproduces ("PM, table 2"), or what it
    /// adds.
    pub reproduces: String,
    /// Horizontal axis.
    pub x: Axis,
    /// Vertical axis.
    pub y: Axis,
    /// The lines; a series with no points is left out of the plot.
    pub series: Vec<Series>,
}

/// A named number; `None` when it could not be measured (a missing peer),
/// which the report shows as missing rather than dropping it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Named {
    /// Who or what ("Open MPI", "memcpy").
    pub name: String,
    /// The value, in the row's unit.
    pub value: Option<f64>,
}

impl Named {
    /// `name` with `value`.
    pub fn new(name: impl Into<String>, value: Option<f64>) -> Self {
        Self {
            name: name.into(),
            value,
        }
    }
}

/// One figure of merit, side by side.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    /// What is measured ("8-byte one-way latency").
    pub what: String,
    /// Unit of every number in the row ("us", "GB/s").
    pub unit: String,
    /// pindown in this run.
    pub ours: Option<f64>,
    /// The paper's number as the paper gives it, with its context
    /// ("7.6 us on Myrinet, PM table 2"); `None` if the paper has none.
    pub paper: Option<String>,
    /// The peers measured in this run.
    pub peers: Vec<Named>,
    /// The physical limit or baseline measured in this run.
    pub limit: Option<Named>,
}

/// A part of the report, built from one program's JSON document.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Section {
    /// Heading.
    pub title: String,
    /// The program (and arguments) whose document it was built from.
    pub program: String,
    /// Plots.
    pub figures: Vec<Figure>,
    /// The side-by-side table.
    pub rows: Vec<Row>,
    /// Peers or baselines that could not be measured, each with the reason.
    pub missing: Vec<String>,
    /// Sentences a reader needs (what the figure means, how it differs
    /// from the paper's set-up).
    pub notes: Vec<String>,
}

impl Section {
    /// An empty section titled `title`, built from `program`'s document.
    pub fn new(title: impl Into<String>, program: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            program: program.into(),
            figures: Vec::new(),
            rows: Vec::new(),
            missing: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// Why a program's document could not be read into a section.
pub type BuildError = String;

/// The value at `path` (keys and array indices joined by `.`, as
/// `pindown.halo.0.us`), or an error naming the path.
pub fn at<'a>(doc: &'a Value, path: &str) -> Result<&'a Value, BuildError> {
    let mut value = doc;
    for key in path.split('.').filter(|k| !k.is_empty()) {
        value = match (value, key.parse::<usize>()) {
            (Value::Array(items), Ok(index)) => items.get(index),
            (Value::Object(map), _) => map.get(key),
            _ => None,
        }
        .ok_or_else(|| format!("the document has no `{path}` (stopped at `{key}`)"))?;
    }
    Ok(value)
}

/// The number at `path`.
pub fn num(doc: &Value, path: &str) -> Result<f64, BuildError> {
    at(doc, path)?
        .as_f64()
        .ok_or_else(|| format!("`{path}` is not a number"))
}

/// The number at `path`, or `None` if it is absent or null (a figure that
/// was not measured).
pub fn opt_num(doc: &Value, path: &str) -> Option<f64> {
    at(doc, path).ok().and_then(Value::as_f64)
}

/// The string at `path`.
pub fn text<'a>(doc: &'a Value, path: &str) -> Result<&'a str, BuildError> {
    at(doc, path)?
        .as_str()
        .ok_or_else(|| format!("`{path}` is not a string"))
}

/// The array at `path`.
pub fn list<'a>(doc: &'a Value, path: &str) -> Result<&'a [Value], BuildError> {
    at(doc, path)?
        .as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| format!("`{path}` is not an array"))
}

/// `(x, y)` points from the array at `path`: each item's `x_key` and
/// `y_key` (themselves paths inside the item).
pub fn points(
    doc: &Value,
    path: &str,
    x_key: &str,
    y_key: &str,
) -> Result<Vec<(f64, f64)>, BuildError> {
    list(doc, path)?
        .iter()
        .map(|item| Ok((num(item, x_key)?, num(item, y_key)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_reach_objects_and_arrays_and_name_what_is_missing() {
        let doc = serde_json::json!({"a": {"b": [{"x": 1, "y": 2.5}, {"x": 2, "y": 3.5}]}});
        assert_eq!(num(&doc, "a.b.1.y").unwrap(), 3.5);
        assert_eq!(
            points(&doc, "a.b", "x", "y").unwrap(),
            vec![(1.0, 2.5), (2.0, 3.5)]
        );
        let err = num(&doc, "a.c.0").unwrap_err();
        assert!(err.contains("`a.c.0`") && err.contains("`c`"), "{err}");
        assert!(opt_num(&doc, "a.b.5.y").is_none());
        assert!(text(&doc, "a.b.0.x").unwrap_err().contains("not a string"));
    }
}
