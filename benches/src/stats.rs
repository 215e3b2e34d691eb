//! Medians and a least-squares line fit.

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
    fn exact_line() {
        let pts: Vec<_> = (1..10)
            .map(|x| (x as f64, 90.8 + 12.3 * x as f64))
            .collect();
        let f = fit_line(&pts).unwrap();
        assert!((f.a - 90.8).abs() < 1e-9 && (f.b - 12.3).abs() < 1e-9);
        assert!((f.r2 - 1.0).abs() < 1e-12);
    }
}
