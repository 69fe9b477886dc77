//! The SSRF guard: which URLs and addresses webhooks may be delivered to.
//!
//! A URL must be `https` (plain `http` only where configured, or to an allowed address), carry
//! no credentials, and its host must resolve only to public unicast addresses: loopback, private,
//! link-local, CGNAT, multicast, unspecified, documentation, reserved and cloud-metadata ranges
//! are refused, in IPv4 and IPv6 (IPv4-mapped, NAT64 and 6to4 addresses by the IPv4 address they
//! carry). The allow-list (`SLUICE_WEBHOOK_ALLOW_CIDRS`) overrides the refusal, and permits
//! plain `http` to its addresses, for tests and private deployments.
//!
//! The host is resolved once, by the HTTP client's resolver ([`GuardedResolver`]), which hands
//! the client only the addresses it checked: the connection goes to a checked address, never to
//! the answer of a second lookup (DNS rebinding).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;
use reqwest::Url;
use thiserror::Error;

/// Why a URL or an address is refused.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct Refused(pub String);

#[derive(Debug, Clone, Default)]
pub struct Guard {
    allow: Vec<IpNet>,
    allow_http: bool,
}

/// The name of the range `ip` is in, when webhooks must not go there.
pub fn forbidden_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        _ if ip == Ipv4Addr::new(169, 254, 169, 254) || ip == Ipv4Addr::new(100, 100, 100, 200) => "a cloud metadata address",
        (0, _, _) => "an unspecified (\"this network\") address",
        (10, _, _) | (172, 16..=31, _) | (192, 168, _) => "a private address",
        (100, 64..=127, _) => "a carrier-grade NAT address",
        (127, _, _) => "a loopback address",
        (169, 254, _) => "a link-local address",
        (192, 0, 0) => "an IETF protocol assignment",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "a documentation address",
        (198, 18..=19, _) => "a benchmarking address",
        (224..=239, _, _) => "a multicast address",
        (240..=255, _, _) => "a reserved or broadcast address",
        _ => return None,
    })
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if let Some(v4) = embedded_v4(ip) {
        return forbidden_v4(v4).or(if s[0] == 0 && s[5] == 0 {
            Some("an IPv4-compatible address")
        } else {
            None
        });
    }
    Some(match s {
        _ if ip.is_unspecified() => "an unspecified address",
        _ if ip.is_loopback() => "a loopback address",
        [0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254] => "a cloud metadata address",
        [a, ..] if a & 0xffc0 == 0xfe80 => "a link-local address",
        [a, ..] if a & 0xffc0 == 0xfec0 => "a site-local address",
        [a, ..] if a & 0xfe00 == 0xfc00 => "a unique local (private) address",
        [a, ..] if a & 0xff00 == 0xff00 => "a multicast address",
        [0x2001, 0x0db8, ..] => "a documentation address",
        [0x0100, 0, 0, 0, ..] => "a discard-only address",
        [a, ..] if a & 0xe000 != 0x2000 => "not a global unicast address",
        _ => return None,
    })
}

/// The IPv4 address an IPv6 address carries: IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible
/// (`::a.b.c.d`), NAT64 (`64:ff9b::a.b.c.d`) and 6to4 (`2002:AABB:CCDD::`).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s {
        [0, 0, 0, 0, 0, 0xffff, ..] => Some(tail),
        [0, 0, 0, 0, 0, 0, hi, _] if hi != 0 => Some(tail),
        [0x64, 0xff9b, 0, 0, 0, 0, ..] => Some(tail),
        [0x2002, hi, lo, ..] => Some(Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)),
        _ => None,
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

impl Guard {
    /// `allow`: CIDRs (`127.0.0.0/8`, `10.1.2.3/32`, `fd00::/8`) that are always allowed, over
    /// `http` too; `allow_http`: plain `http` to public addresses as well.
    pub fn new(allow: &[String], allow_http: bool) -> Result<Guard, Refused> {
        let allow = allow
            .iter()
            .filter(|c| !c.trim().is_empty())
            .map(|c| {
                let c = c.trim();
                c.parse::<IpNet>()
                    .or_else(|_| c.parse::<IpAddr>().map(IpNet::from))
                    .map(|n| n.trunc())
                    .map_err(|_| Refused(format!("SLUICE_WEBHOOK_ALLOW_CIDRS: {c:?} is not a CIDR")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Guard { allow, allow_http })
    }

    fn allowed_explicitly(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.allow.iter().any(|net| net.contains(&ip))
    }

    /// Whether a connection to `ip` is allowed, for a URL of scheme `https` or not.
    pub fn check_ip(&self, ip: IpAddr, https: bool) -> Result<(), Refused> {
        if self.allowed_explicitly(ip) {
            return Ok(());
        }
        if let Some(range) = forbidden_range(canonical(ip)) {
            return Err(Refused(format!("{ip} is {range}")));
        }
        if !https && !self.allow_http {
            return Err(Refused(format!(
                "plain http to {ip} is not allowed (https is required outside SLUICE_WEBHOOK_ALLOW_CIDRS)"
            )));
        }
        Ok(())
    }

    /// What can be judged of a URL without resolving its host (at submit time, and again
    /// before each delivery): its scheme, credentials, and an IP-literal or `localhost` host.
    pub fn check_url(&self, url: &str) -> Result<Url, Refused> {
        let parsed = Url::parse(url).map_err(|e| Refused(format!("not an absolute URL: {e}")))?;
        let https = match parsed.scheme() {
            "https" => true,
            "http" => false,
            other => return Err(Refused(format!("scheme {other:?}: https is required"))),
        };
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(Refused("credentials in the URL are not allowed; the request is signed".into()));
        }
        match parsed.host() {
            None => return Err(Refused("the URL has no host".into())),
            Some(url::Host::Ipv4(ip)) => self.check_ip(IpAddr::V4(ip), https)?,
            Some(url::Host::Ipv6(ip)) => self.check_ip(IpAddr::V6(ip), https)?,
            Some(url::Host::Domain(name)) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                if name == "localhost" || name.ends_with(".localhost") {
                    self.check_ip(IpAddr::V4(Ipv4Addr::LOCALHOST), https)
                        .map_err(|_| Refused(format!("{name} is a loopback name")))?;
                }
            }
        }
        Ok(parsed)
    }
}

/// The webhook client's DNS resolver: resolves once and returns only the addresses the guard
/// allows (refusing the name when none is), so the client connects to a checked address.
pub struct GuardedResolver {
    guard: Arc<Guard>,
    https: bool,
}

impl GuardedResolver {
    /// A resolver for the client of `https` URLs, or of plain `http` ones.
    pub fn new(guard: Arc<Guard>, https: bool) -> GuardedResolver {
        GuardedResolver { guard, https }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.guard.clone();
        let https = self.https;
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let mut refusals = Vec::new();
            let allowed: Vec<SocketAddr> = addrs
                .into_iter()
                .filter(|a| match guard.check_ip(a.ip(), https) {
                    Ok(()) => true,
                    Err(r) => {
                        refusals.push(r.0);
                        false
                    }
                })
                .collect();
            if allowed.is_empty() {
                let why = if refusals.is_empty() {
                    "no address".to_owned()
                } else {
                    refusals.join("; ")
                };
                return Err(Box::new(Refused(format!("{host} resolves to {why}"))) as Box<dyn std::error::Error + Send + Sync>);
            }
            // Only some addresses refused: the client gets the others (a mixed answer is how
            // rebinding attacks look, so it must never reach a refused one).
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The guard's refusal somewhere in an error's sources (a connection refused by the resolver).
pub fn refusal_in(error: &(dyn std::error::Error + 'static)) -> Option<Refused> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(r) = e.downcast_ref::<Refused>() {
            return Some(r.clone());
        }
        current = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(guard: &Guard, url: &str) -> bool {
        guard.check_url(url).is_err()
    }

    #[test]
    fn refuses_internal_addresses_of_both_families() {
        let g = Guard::new(&[], false).unwrap();
        for url in [
            "https://127.0.0.1/x",
            "https://10.0.0.5/",
            "https://172.20.1.1/",
            "https://192.168.1.1/",
            "https://100.64.0.1/",
            "https://169.254.169.254/latest/meta-data/",
            "https://100.100.100.200/",
            "https://0.0.0.0/",
            "https://224.0.0.1/",
            "https://255.255.255.255/",
            "https://[::1]/",
            "https://[::]/",
            "https://[fe80::1]/",
            "https://[fc00::1]/",
            "https://[fd00:ec2::254]/",
            "https://[ff02::1]/",
            "https://[::ffff:127.0.0.1]/",
            "https://[::ffff:169.254.169.254]/",
            "https://[64:ff9b::a00:1]/",
            "https://[2002:c0a8:101::]/",
            "https://[2001:db8::1]/",
            "https://localhost/",
            "https://api.localhost./",
            "http://93.184.216.34/",
            "ftp://93.184.216.34/",
            "https://user:pw@93.184.216.34/",
            "not a url",
        ] {
            assert!(refused(&g, url), "{url} should be refused");
        }
        for url in [
            "https://93.184.216.34/hook",
            "https://[2606:2800:220:1:248:1893:25c8:1946]/",
            "https://hooks.example.com/x",
            "https://[64:ff9b::5db8:d822]/",
        ] {
            assert!(!refused(&g, url), "{url} should be allowed");
        }
    }

    #[test]
    fn the_allow_list_permits_its_addresses_over_http() {
        let g = Guard::new(&["127.0.0.0/8".into(), "fd00::/8".into()], false).unwrap();
        assert!(!refused(&g, "http://127.0.0.1:9000/hook"));
        assert!(!refused(&g, "http://localhost:9000/hook"));
        assert!(!refused(&g, "http://[::ffff:127.0.0.1]/"));
        assert!(!refused(&g, "https://[fd12::1]/"));
        assert!(refused(&g, "http://10.0.0.1/"));
        assert!(
            refused(&g, "http://93.184.216.34/"),
            "plain http to a public address needs SLUICE_WEBHOOK_ALLOW_HTTP"
        );
        let open_http = Guard::new(&[], true).unwrap();
        assert!(!refused(&open_http, "http://93.184.216.34/"));
        assert!(refused(&open_http, "http://127.0.0.1/"));
        assert!(Guard::new(&["not-a-cidr".into()], false).is_err());
    }

    #[tokio::test]
    async fn the_resolver_hands_out_checked_addresses_only() {
        use reqwest::dns::Resolve;
        let strict = GuardedResolver::new(Arc::new(Guard::new(&[], false).unwrap()), true);
        let err = match strict.resolve("localhost".parse().unwrap()).await {
            Err(e) => e,
            Ok(_) => panic!("localhost resolved through the guard"),
        };
        assert!(refusal_in(err.as_ref()).is_some(), "{err}");
        let allowed = GuardedResolver::new(
            Arc::new(Guard::new(&["127.0.0.0/8".into(), "::1/128".into()], false).unwrap()),
            false,
        );
        let addrs: Vec<SocketAddr> = allowed.resolve("localhost".parse().unwrap()).await.unwrap().collect();
        assert!(!addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
    }
}
