//! `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`, as the OpenTelemetry specification
//! names them. The default is `parentbased_always_on`: a sampled `traceparent` from the client
//! is always honoured, and a request without one starts a sampled trace.

use opentelemetry_sdk::trace::Sampler;

use crate::error::TelemetryError;

pub const SAMPLER_ENV: &str = "OTEL_TRACES_SAMPLER";
pub const SAMPLER_ARG_ENV: &str = "OTEL_TRACES_SAMPLER_ARG";

/// Parses a sampler name and its optional argument. A ratio sampler without an argument samples
/// everything (ratio 1.0), as the specification says.
pub fn parse_sampler(name: &str, arg: Option<&str>) -> Result<Sampler, TelemetryError> {
    let ratio = || -> Result<f64, TelemetryError> {
        let Some(arg) = arg.map(str::trim).filter(|a| !a.is_empty()) else {
            return Ok(1.0);
        };
        match arg.parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
            _ => Err(TelemetryError::InvalidSamplerArg {
                sampler: name.to_owned(),
                given: arg.to_owned(),
            }),
        }
    };
    let parent_based = |root: Sampler| Sampler::ParentBased(Box::new(root));
    Ok(match name.trim().to_ascii_lowercase().as_str() {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::TraceIdRatioBased(ratio()?),
        "" | "parentbased_always_on" => parent_based(Sampler::AlwaysOn),
        "parentbased_always_off" => parent_based(Sampler::AlwaysOff),
        "parentbased_traceidratio" => parent_based(Sampler::TraceIdRatioBased(ratio()?)),
        _ => {
            return Err(TelemetryError::UnknownSampler {
                given: name.to_owned(),
            })
        }
    })
}

/// The sampler the environment asks for (`parentbased_always_on` when unset).
pub fn sampler_from_env() -> Result<Sampler, TelemetryError> {
    let name = std::env::var(SAMPLER_ENV).unwrap_or_default();
    let arg = std::env::var(SAMPLER_ARG_ENV).ok();
    parse_sampler(&name, arg.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn show(s: &Sampler) -> String {
        format!("{s:?}")
    }

    #[test]
    fn default_is_parent_based_always_on() {
        let s = parse_sampler("", None).unwrap();
        assert!(matches!(s, Sampler::ParentBased(_)), "{s:?}");
        assert!(show(&s).contains("AlwaysOn"), "{s:?}");
    }

    #[test]
    fn names_are_case_insensitive_and_trimmed() {
        assert!(matches!(
            parse_sampler(" Always_On ", None).unwrap(),
            Sampler::AlwaysOn
        ));
        assert!(matches!(
            parse_sampler("always_off", None).unwrap(),
            Sampler::AlwaysOff
        ));
        let s = parse_sampler("parentbased_always_off", None).unwrap();
        assert!(
            matches!(s, Sampler::ParentBased(_)) && show(&s).contains("AlwaysOff"),
            "{s:?}"
        );
    }

    #[test]
    fn ratio_samplers_take_their_argument() {
        match parse_sampler("traceidratio", Some("0.25")).unwrap() {
            Sampler::TraceIdRatioBased(r) => assert_eq!(r, 0.25),
            s => panic!("{s:?}"),
        }
        let s = parse_sampler("parentbased_traceidratio", Some("0.1")).unwrap();
        assert!(
            matches!(s, Sampler::ParentBased(_)) && show(&s).contains("0.1"),
            "{s:?}"
        );
        match parse_sampler("traceidratio", None).unwrap() {
            Sampler::TraceIdRatioBased(r) => assert_eq!(r, 1.0),
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn bad_input_names_the_value() {
        let err = parse_sampler("sometimes", None).unwrap_err();
        assert!(err.to_string().contains("\"sometimes\""), "{err}");
        for bad in ["1.5", "-0.1", "half", "NaN"] {
            let err = parse_sampler("parentbased_traceidratio", Some(bad)).unwrap_err();
            assert!(
                matches!(err, TelemetryError::InvalidSamplerArg { ref given, .. } if given == bad),
                "{err}"
            );
        }
    }
}
