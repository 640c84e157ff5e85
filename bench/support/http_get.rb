# frozen_string_literal: true

require "net/http"

module NeverBlockBench
  # The one request every client benchmark and the demo makes: a GET over a
  # fresh Net::HTTP connection, so every client does the same work (connect,
  # request, response, close) whatever runs it.
  module HTTPGet
    module_function

    # @param host [String]
    # @param port [Integer]
    # @param path [String] e.g. "/delay/0.5"
    # @return [nil, String] nil on a 200 response, otherwise what went wrong
    #   ("HTTP 500", "Errno::ECONNRESET: ..."); never raises StandardError
    def call(host, port, path)
      # p_addr nil: never go through an http_proxy from the environment.
      response = Net::HTTP.start(host, port, nil) { |http| http.get(path) }
      response.code == "200" ? nil : "HTTP #{response.code}"
    rescue StandardError => e
      "#{e.class}: #{e.message}"
    end
  end
end
