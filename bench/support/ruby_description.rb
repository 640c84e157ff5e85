# frozen_string_literal: true

module NeverBlockBench
  # What a benchmark app answers to GET /ruby, and what PeerServers.check_ruby compares it with:
  # this Ruby and whether YJIT is on in it, e.g. "ruby 3.4.5 ... yjit=true\n".
  def self.ruby_description = "#{RUBY_DESCRIPTION} yjit=#{defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled? ? true : false}\n"
end
