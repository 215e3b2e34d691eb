//! Medians, percentiles, summaries of samples and a least-squares line fit.

use serde::Serialize;

/// Median of `values` (mean of the two middle values for an even count);
/// `NaN` for an empty slice. Sorts `values` in place.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// The `q`-quantile (`0.0..=1.0`) of `sorted` (ascending) by the
/// nearest-rank method: the smallest value with at least `q` of the values at
/// or below it. `NaN` for an empty slice.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median, 99th percentile, mean and extremes of a set of samples, in the
/// samples' unit.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub samples: usize,
    /// Median (mean of the two middle values for an even count).
    pub median: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Arithmetic mean.
    pub mean: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

impl Summary {
    /// Summarises `values` (sorted in place); all `NaN` when empty.
    pub fn of(values: &mut [f64]) -> Self {
        let median = median(values);
        let n = values.len();
        let mean = if n == 0 {
            f64::NAN
        } else {
            values.iter().sum::<f64>() / n as f64
        };
        Summary {
            samples: n,
            median,
            p99: percentile(values, 0.99),
            mean,
            min: values.first().copied().unwrap_or(f64::NAN),
            max: values.last().copied().unwrap_or(f64::NAN),
        }
    }
}

/// The line `y = a + b * x` that minimises the squared vertical distances.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct LineFit {
    /// Intercept.
    pub a: f64,
    /// Slope.
    pub b: f64,
    /// Coefficient of determination (1 = the points lie on the line).
    pub r2: f64,
}

/// Ordinary least-squares fit of `y = a + b * x`; `None` with fewer than two
/// distinct `x`.
pub fn fit_line(points: &[(f64, f64)]) -> Option<LineFit> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my) * (p.1 - my)).sum();
    if sxx == 0.0 {
        return None;
    }
    let b = sxy / sxx;
    let a = my - b * mx;
    let r2 = if syy == 0.0 {
        1.0
    } else {
        (sxy * sxy) / (sxx * syy)
    };
    Some(LineFit { a, b, r2 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn percentiles_and_summary() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 0.99), 99.0);
        assert_eq!(percentile(&sorted, 0.5), 50.0);
        assert_eq!(percentile(&sorted, 0.0), 1.0);
        assert_eq!(percentile(&sorted, 1.0), 100.0);
        assert!(percentile(&[], 0.5).is_nan());
        let mut values = vec![4.0, 1.0, 3.0, 2.0];
        let s = Summary::of(&mut values);
        assert_eq!((s.samples, s.median, s.mean), (4, 2.5, 2.5));
        assert_eq!((s.min, s.max, s.p99), (1.0, 4.0, 4.0));
        assert!(Summary::of(&mut []).median.is_nan());
    }

    #[test]
    fn exact_line() {
        let pts: Vec<_> = (1..10)
            .map(|x| (x as f64, 90.8 + 12.3 * x as f64))
            .collect();
        let f = fit_line(&pts).unwrap();
        assert!((f.a - 90.8).abs() < 1e-9 && (f.b - 12.3).abs() < 1e-9);
        assert!((f.r2 - 1.0).abs() < 1e-12);
    }
}
