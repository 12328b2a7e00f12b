//! The engines a transfer handler can be asked for, by name: the one list that the bindings, the
//! Python package (`kvoff._native.ENGINES`) and the vLLM plug-in's settings all take their names
//! from, and the one place where a name and the tensors' placement decide which engine serves.

use crate::error::{KvoffError, Result};

/// An engine choice (the `engine=` setting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// CUDA with the method chosen per job when the GPU-side tensors are CUDA tensors, otherwise
    /// the host engine.
    Auto,
    /// The host engine: `memcpy` on worker threads (CPU tensors on both sides).
    Host,
    /// CUDA, method chosen per job (like `Auto`, but CUDA is required).
    Cuda,
    /// CUDA, batched DMA for every job.
    Dma,
    /// CUDA, the gather/scatter copy kernel (needs pinned, device-mapped host memory).
    Kernel,
    /// CUDA, kernel through device staging plus DMA of host-contiguous runs.
    Staged,
    /// CUDA, one `cuMemcpyAsync` per copy (a baseline for benchmarks).
    Loop,
}

impl EngineKind {
    /// Every choice, in the order the documentation lists them.
    pub const ALL: [Self; 7] = [
        Self::Auto,
        Self::Host,
        Self::Cuda,
        Self::Dma,
        Self::Kernel,
        Self::Staged,
        Self::Loop,
    ];

    /// The setting's spelling.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Host => "host",
            Self::Cuda => "cuda",
            Self::Dma => "dma",
            Self::Kernel => "kernel",
            Self::Staged => "staged",
            Self::Loop => "loop",
        }
    }

    /// Parses a name of [`ALL`](Self::ALL).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] naming the valid choices.
    pub fn parse(s: &str) -> Result<Self> {
        crate::error::parse_name(s, &Self::ALL, Self::name, "engine", |names| {
            let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
            quoted.join(", ")
        })
    }

    /// Whether the choice always needs CUDA (every one but `Auto` and `Host`).
    #[must_use]
    pub const fn needs_cuda(self) -> bool {
        !matches!(self, Self::Auto | Self::Host)
    }

    /// Decides between the host and a CUDA engine for GPU-side tensors placed as `gpu` (one entry
    /// per tensor: its CUDA device index, `None` for host memory; `names[i]` says what tensor `i`
    /// is, for messages), given whether CUDA is usable here. Returns whether a CUDA engine serves.
    ///
    /// # Errors
    /// [`KvoffError::CudaUnavailable`] when CUDA is needed and unusable here;
    /// [`KvoffError::InvalidArgument`] when the tensors do not fit the choice: host tensors with a
    /// CUDA engine, CUDA tensors with the host engine, tensors on several devices.
    pub fn resolve(self, gpu: &[Option<i64>], names: &[String], cuda_usable: bool) -> Result<bool> {
        let name = |i: usize| {
            names
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("GPU-side tensor {i}"))
        };
        let on_host = gpu.iter().position(Option::is_none);
        let on_cuda = gpu.iter().position(Option::is_some);
        let use_cuda = self.needs_cuda() || (self == Self::Auto && on_cuda.is_some());
        let me = self.name();
        if !use_cuda {
            if let Some(i) = on_cuda {
                return Err(KvoffError::arg(format!(
                    "engine \"host\" copies with memcpy, but {} is on cuda:{}; use engine=\"auto\" \
                     or \"cuda\" for GPU tensors",
                    name(i),
                    gpu[i].unwrap_or(0)
                )));
            }
            return Ok(false);
        }
        let where_ = on_host.map(|i| format!("{} is on cpu", name(i)));
        if !cuda_usable {
            return Err(KvoffError::CudaUnavailable(format!(
                "engine {me:?} needs CUDA, but kvoff found no CUDA driver or device{}; use \
                 engine=\"auto\" or \"host\"",
                where_.map(|w| format!(" (and {w})")).unwrap_or_default()
            )));
        }
        if let Some(w) = where_ {
            return Err(KvoffError::arg(format!(
                "engine {me:?} copies between CUDA device memory and host memory, but {w}; use \
                 engine=\"host\" (or \"auto\") for CPU tensors"
            )));
        }
        let first = gpu.first().copied().flatten().unwrap_or(0);
        if let Some(i) = gpu.iter().position(|d| *d != Some(first)) {
            return Err(KvoffError::arg(format!(
                "GPU-side tensors are on different devices ({} on cuda:{first}, {} on cuda:{}); \
                 one handler serves one device",
                name(0),
                name(i),
                gpu[i].unwrap_or(0)
            )));
        }
        Ok(true)
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::EngineKind;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for k in EngineKind::ALL {
            assert_eq!(EngineKind::parse(k.name()).unwrap(), k);
        }
        let e = EngineKind::parse("fast").unwrap_err().to_string();
        assert!(
            e.contains("\"auto\", \"host\", \"cuda\", \"dma\", \"kernel\", \"staged\", \"loop\""),
            "{e}"
        );
    }

    #[test]
    fn resolve_follows_the_placement() {
        let n = vec!["a".to_owned(), "b".to_owned()];
        assert!(!EngineKind::Auto.resolve(&[None, None], &n, true).unwrap());
        assert!(EngineKind::Auto
            .resolve(&[Some(1), Some(1)], &n, true)
            .unwrap());
        assert!(EngineKind::Host.resolve(&[Some(0)], &n, true).is_err());
        let e = EngineKind::Dma.resolve(&[None], &n, false).unwrap_err();
        assert!(matches!(e, crate::KvoffError::CudaUnavailable(_)), "{e}");
        assert!(e.to_string().contains("a is on cpu"), "{e}");
        let e = EngineKind::Dma
            .resolve(&[Some(0), None], &n, true)
            .unwrap_err();
        assert!(e.to_string().contains("b is on cpu"), "{e}");
        let e = EngineKind::Cuda
            .resolve(&[Some(0), Some(1)], &n, true)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("different devices (a on cuda:0, b on cuda:1)"),
            "{e}"
        );
    }
}
