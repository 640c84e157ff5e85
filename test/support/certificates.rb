# frozen_string_literal: true

require "openssl"

# Certificates made for a test: a self-signed one for an IP address, with
# its key, written as PEM files.
module TestCertificates
  module_function

  # @return [Array(String, String)] the certificate's and the key's paths in `dir`.
  def write_self_signed(dir, ip = "127.0.0.1")
    cert, key = self_signed(ip)
    paths = [File.join(dir, "cert.pem"), File.join(dir, "key.pem")]
    File.write(paths[0], cert.to_pem)
    File.write(paths[1], key.private_to_pem)
    paths
  end

  # @param name [String] an IP address or a host name.
  # @return [Array(OpenSSL::X509::Certificate, OpenSSL::PKey::RSA)]
  def self_signed(name)
    key = OpenSSL::PKey::RSA.new(2048)
    cert = OpenSSL::X509::Certificate.new
    cert.version = 2
    cert.serial = 1
    cert.subject = cert.issuer = OpenSSL::X509::Name.parse("/CN=#{name}")
    cert.public_key = key.public_key
    cert.not_before = Time.now - 60
    cert.not_after = Time.now + 3600
    extensions = OpenSSL::X509::ExtensionFactory.new(cert, cert)
    alt_name = name.match?(/\A[\d.]+\z|:/) ? "IP:#{name}" : "DNS:#{name}"
    cert.add_extension(extensions.create_extension("subjectAltName", alt_name, false))
    cert.add_extension(extensions.create_extension("basicConstraints", "CA:TRUE", true))
    cert.sign(key, OpenSSL::Digest.new("SHA256"))
    [cert, key]
  end

  # @param name [String] an IP address or a host name.
  # @return [OpenSSL::SSL::SSLContext] a server's, with a certificate of its own for `name`.
  def server_context(name)
    certificate, key = self_signed(name)
    context = OpenSSL::SSL::SSLContext.new
    context.cert = certificate
    context.key = key
    context
  end
end
